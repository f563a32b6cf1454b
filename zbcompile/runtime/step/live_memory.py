"""Bytes of activation memory: what a set of tensors keeps alive (`held_bytes`), and what is
alive inside an action while a stage's graph runs (`TransientTracker`).

`TransientTracker` counts the storages the action took in (`take`) and every storage an op creates,
each from then until it dies, each once. It is a dispatch mode (`TorchDispatchMode`, through
`_torch_internals`): after each op it counts the output storages that none of the op's tensor
arguments owns (views and in-place results reuse their input's storage and are not new), and a weak
reference on each counted storage takes its bytes off when the storage dies (torch keeps one Python
object per live storage, so the reference fires when the last tensor on it goes, wherever that
tensor is held). `peak` is the most bytes alive at once, seen right after each op (an op's inputs
are alive while it allocates its output, and memory only rises at allocations). Not seen: memory an
op allocates and frees inside itself (a kernel's workspace), and buffers allocated outside the
dispatcher (Inductor-generated code allocates its intermediates directly; what a compiled graph
returns is counted by the executor after the action).

On CUDA the caching allocator knows better: `peak_inside` reads `torch.cuda`'s memory
statistics around the action instead (`AllocatorPeak`: what the allocator handed out, rounded up
to its blocks, kernels' workspaces included; NCCL's own buffers are not the allocator's), and
adds what the action took in. It resets the device's peak statistics around every measured action.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from zbcompile._torch_internals import TorchDispatchMode, pytree


def storage_bytes(values) -> dict[int, tuple[torch.UntypedStorage, int]]:
    """By storage (its id): the storage and the bytes `values` (tensors; other values skipped)
    keep alive of it: the whole storage, but no more than the bytes its tensors here span (a
    microbatch that is a slice of the batch holds its slice's bytes)."""
    spans: dict[int, list] = {}
    for value in values:
        if not isinstance(value, torch.Tensor):  # an op's absent optional output (None)
            continue
        storage = value.untyped_storage()
        entry = spans.setdefault(id(storage), [storage, 0])
        entry[1] += value.numel() * value.element_size()
    return {key: (storage, min(storage.nbytes(), spanned)) for key, (storage, spanned) in spans.items()}


def held_bytes(values) -> int:
    """Memory a set of tensors keeps alive, each storage once (see `storage_bytes`)."""
    return sum(nbytes for _, nbytes in storage_bytes(values).values())


class TransientTracker(TorchDispatchMode):
    """While active: the bytes of the storages taken in or created since it started and still
    alive (`current`), and their highest value (`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref] = {}  # id(storage) -> its reference, while it lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                self._count(value.untyped_storage(), inputs)
        self.peak = max(self.peak, self.current)
        return result

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._alive.clear()  # its references go, and their callbacks with them

    def take(self, values) -> None:
        """Count the storages of `values` (the action's inputs) until they die."""
        for key, (storage, nbytes) in storage_bytes(values).items():
            if key not in self._alive:
                self._add(key, storage, nbytes)
        self.peak = max(self.peak, self.current)

    def _count(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key = id(storage)
        if key not in inputs and key not in self._alive:
            self._add(key, storage, storage.nbytes())

    def _add(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.current += nbytes
        self._alive[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._died(key, nbytes))

    def _died(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.current -= nbytes


class AllocatorPeak:
    """While active: the most bytes `cuda`'s caching allocator had allocated on `device` above what
    it had when the block started (`peak`, from `memory_allocated`, `reset_peak_memory_stats`,
    `max_memory_allocated`). `cuda` stands in for `torch.cuda` in CPU tests."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device, self.cuda = device, cuda
        self.peak = 0

    def __enter__(self) -> AllocatorPeak:
        self._base = self.cuda.memory_allocated(self.device)
        self.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.peak = max(0, self.cuda.max_memory_allocated(self.device) - self._base)


def peak_inside(run: Callable[[], None], taken, device: torch.device, cuda: Any = torch.cuda) -> int:
    """Run `run` (an action given the tensors `taken`: pass a view such as `env.values()`, so
    that nothing here keeps them alive) and return the most bytes alive inside it:
    what it took in plus what it allocated, at most, while it ran; by the allocator's statistics
    on CUDA, else by `TransientTracker`."""
    if device.type == "cuda":
        taken_bytes = held_bytes(taken)
        with AllocatorPeak(device, cuda) as allocator:
            run()
        return taken_bytes + allocator.peak
    with TransientTracker() as tracker:
        tracker.take(taken)
        run()
    return tracker.peak
