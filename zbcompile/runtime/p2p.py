"""Point-to-point messages between pipeline ranks over torch.distributed, with a timeout on
every wait and errors that name the peer and the action. The device follows the process
group's backend (CPU for gloo, the current CUDA device for NCCL): one code path for both."""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist


def device_for(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors must live for `group`'s backend."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_objects(value: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's `value` over `group`, in group order (a collective of its ranks); `[value]`
    when `group` is None (a pipeline of this rank alone)."""
    if group is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


class MessageTransport(Protocol):
    """What the step interpreter (`runtime/dispatch.py`) uses of a transport: `Transport` between
    ranks, `local.InProcessTransport` between the stages of one process. A receive is posted
    with its buffers and returns a handle that `wait` turns into the received tensors."""

    matches_by_tag: bool

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False) -> Any: ...

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None: ...

    def can_tell(self, pending: Any) -> bool: ...

    def arrived(self, pending: Any) -> bool: ...

    def wait(self, pending: Any, waiting_action: str) -> list[torch.Tensor]: ...

    def arrival_time(self, pending: Any) -> float | None: ...

    def flush_sends(self) -> None: ...


class PeerError(RuntimeError):
    """A message did not arrive (timeout) or its peer went away."""


@dataclass
class Pending:
    """Posted receives or sends of one message. Where a helper thread posts a send (gloo),
    `posted` is set once it has (or failed: `error`); where one waits for a receive, `done` is
    set once it completed (at `arrived_at`) or failed (`error`, `timed_out`)."""

    works: list
    tensors: list[torch.Tensor]
    peer: int
    action: str
    posted: threading.Event | None = None
    done: threading.Event | None = None
    arrived_at: float | None = None
    error: BaseException | None = None
    timed_out: bool = False


class _Poster:
    """A thread that posts sends in the order they are given. gloo's `isend` can block the
    calling thread for milliseconds while the process computes (it waits for gloo's own network
    thread, which competes for the cores), so the runner's thread hands sends over here and goes
    on computing. With gloo, messages are paired by tag, so posting on another thread cannot
    change what a peer sees. (Receives stay on the runner's thread: posted there they cost
    less, once arrived, than a handover would.)"""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def post(self, pending: Pending, post: Callable[[], list]) -> None:
        pending.posted = threading.Event()
        self._jobs.put((pending, post))

    def _serve(self) -> None:
        while True:
            pending, post = self._jobs.get()
            try:
                pending.works = post()
            except RuntimeError as error:
                pending.error = error
            pending.posted.set()


class _Watch:
    """Threads that wait for posted gloo receives, so that the runner can learn without blocking
    whether a message has arrived: gloo's `Work` has no such test (`is_completed()` turns true
    only inside `wait()`), and a wait with a short timeout aborts the process group. Each
    receive gets a thread of its own (idle ones are reused), so a message never waits on
    another. The threads are daemons and hold no Python lock while they wait."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def watch(self, pending: Pending) -> None:
        """Wait for the posted receive `pending` on a thread of its own."""
        pending.done = threading.Event()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="zbcompile-arrival", daemon=True).start()
        jobs.put(pending)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            pending = jobs.get()
            try:
                for work in pending.works:
                    if work.wait(self.timeout) is False:
                        pending.timed_out = True
            except RuntimeError as error:
                pending.error = error
            pending.arrived_at = time.perf_counter()
            with self._lock:
                self._idle.append(jobs)
            pending.done.set()


class Transport:
    """Sends and receives the tensors of one message (several tensors to one peer are posted as
    one batch). Every wait gives up after `timeout` and raises a PeerError naming the peer rank
    and the action that was waiting. With gloo, a helper thread posts the sends (`_Poster`), and
    `arrived()` tells without blocking whether a receive posted with `watch=True` has completed
    (a thread waits for it, `_Watch`)."""

    def __init__(self, rank: int, timeout: timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        self._sends: list[Pending] = []

    @functools.cached_property
    def matches_by_tag(self) -> bool:
        """gloo pairs a send with its receive by tag; NCCL (and the others) by order per peer."""
        return dist.get_backend() == "gloo"

    @functools.cached_property
    def _helpers(self) -> tuple[_Poster, _Watch] | None:
        """(send poster, watch) where the backend pairs messages by tag (posting on another
        thread cannot reorder what a peer sees) and its works cannot be tested without
        blocking: gloo. None elsewhere (NCCL: the runner's thread posts, in order)."""
        if not self.matches_by_tag:
            return None
        return _Poster("zbcompile-send"), _Watch(self.timeout)

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False) -> Pending:
        pending = Pending(self._post(dist.irecv, buffers, peer, tag, action), list(buffers), peer, action)
        if watch and self._helpers is not None:
            self._helpers[1].watch(pending)
        return pending

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        pending = Pending([], [t.contiguous() for t in tensors], peer, action)
        post = functools.partial(self._post, dist.isend, pending.tensors, peer, tag, action)
        if self._helpers is None:
            pending.works = post()
        else:
            self._helpers[0].post(pending, post)
        self._sends.append(pending)

    def can_tell(self, pending: Pending) -> bool:
        """Whether `arrived(pending)` can tell: NCCL's works can; a gloo receive only if watched."""
        return pending.done is not None or not self.matches_by_tag

    def arrived(self, pending: Pending) -> bool:
        """Whether `pending` (a receive) has completed, without blocking (see `can_tell`)."""
        if pending.done is not None:
            return pending.done.is_set()
        return not self.matches_by_tag and all(work.is_completed() for work in pending.works)

    def wait(self, pending: Pending, waiting_action: str) -> list[torch.Tensor]:
        """The received tensors, once they are there."""
        self._complete(pending, f"{waiting_action} (waiting for {pending.action})")
        return pending.tensors

    def arrival_time(self, pending: Pending) -> float | None:
        """When a completed receive arrived (`time.perf_counter()`), where a helper thread saw it."""
        return pending.arrived_at

    def flush_sends(self) -> None:
        """Wait for every send posted so far (their tensors can then be freed)."""
        sends, self._sends = self._sends, []
        for pending in sends:
            self._complete(pending, pending.action)

    def _complete(self, pending: Pending, action: str) -> None:
        """Wait until `pending` completed: for its watching thread, else for its posting thread
        and then its works; raise a PeerError where any of them failed or timed out."""
        # a helper thread's own wait gives up after `timeout`; these only back it up
        event = pending.done or pending.posted
        if event is not None and not event.wait(self.timeout.total_seconds() + 30):
            pending.timed_out = True
        if pending.error is not None:
            raise self._peer_failed(pending.peer, action, pending.error) from pending.error
        if pending.timed_out:
            raise self._timed_out(pending.peer, action)
        if pending.done is None:
            for work in pending.works:
                self._wait_one(work, pending.peer, action)

    def _post(self, op, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> list:
        """Post `op` (dist.isend or dist.irecv) for every tensor; several go as one batch."""
        try:
            if len(tensors) <= 1:  # batching costs more than a single message on CPU
                return [op(t, peer, tag=tag) for t in tensors]
            return dist.batch_isend_irecv([dist.P2POp(op, t, peer, tag=tag) for t in tensors])
        except RuntimeError as error:
            raise PeerError(f"rank {self.rank}: posting {action} to/from rank {peer} failed: {error}") from error

    def _wait_one(self, work, peer: int, action: str) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise self._peer_failed(peer, action, error) from error
        if completed is False:
            raise self._timed_out(peer, action)

    def _peer_failed(self, peer: int, action: str, error: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank}: {action} failed on its message with rank {peer} "
            f"(peer rank {peer} may have died or timed out after {self.timeout.total_seconds():.0f} s): "
            f"{str(error).splitlines()[0]}"
        )

    def _timed_out(self, peer: int, action: str) -> PeerError:
        return PeerError(
            f"rank {self.rank}: timed out after {self.timeout.total_seconds():.0f} s in {action} "
            f"waiting for peer rank {peer}"
        )
