"""Deferred weight gradients for code compiled with the `zbcompile` backend.

    with zbcompile.defer_weight_grads() as store:
        loss.backward()          # I only: input gradients flow, parameter .grad untouched
        ...                      # send input gradients upstream, run other work
        store.run()              # W: every queued weight gradient, in order, into .grad

Design: leaving the block runs whatever W is still queued, so after the block the backward is
complete, as after any backward (a `store.run()` inside the block picks the moment earlier).
If the block is left by an exception, the queued W is dropped instead. Blocks nest; backward
passes queue into the innermost one. Outside every block, compiled regions run their complete
backward. The store is process-wide (not per thread): autograd may run a backward on its own
worker threads.

Caveat: a compiled region's backward hands autograd `None` in place of each deferred parameter
gradient, so gradient hooks on parameters (`register_post_accumulate_grad_hook`, DDP's
all-reduce hooks) fire at I time, before W has written `.grad`. Run the work such hooks do after
`store.run()` (for data parallelism: all-reduce the gradients after W, or use `no_sync`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch


class WeightGradStore:
    """Queued weight-gradient work (W) of compiled regions, in the order their backward ran."""

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def pending_parameters(self) -> list[tuple[torch.nn.Parameter, ...]]:
        """For inspection: the parameters each queued W writes, in queue order."""
        with self._lock:
            return [tuple(getattr(work, "parameters", ())) for work in self._queue]

    def put(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(work)

    def run(self) -> None:
        """Run every queued W in order, accumulating into the parameters' `.grad`."""
        self.take()()

    def take(self) -> Callable[[], None]:
        """Remove the W queued so far and return a function that runs it (in order). This is the
        shape of `torch.distributed.pipelining.PipelineStage`'s `dw_builder`."""
        with self._lock:
            works, self._queue = list(self._queue), deque()

        def run_taken() -> None:
            for work in works:
                work()

        return run_taken

    def clear(self) -> None:
        """Drop the queued W (the parameters keep the gradients they have)."""
        with self._lock:
            self._queue.clear()


_stores: list[WeightGradStore] = []


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[WeightGradStore]:
    """Defer the weight gradients of compiled regions' backward passes run inside the block to
    the yielded store (see the module docstring for what leaving the block does)."""
    store = WeightGradStore()
    _stores.append(store)
    try:
        yield store
    except BaseException:
        store.clear()
        raise
    finally:
        _stores.remove(store)
    store.run()


def active_store() -> WeightGradStore | None:
    """The innermost `defer_weight_grads` store, or None outside every block."""
    return _stores[-1] if _stores else None


def take_weight_grads() -> Callable[[], None]:
    """A `dw_builder` for `PipelineStage`: the W queued in the active store since the last call,
    as one function (a no-op outside a `defer_weight_grads` block, where backward is complete)."""
    store = active_store()
    return store.take() if store is not None else _nothing


def _nothing() -> None:
    return None
