"""Point-to-point messages between pipeline ranks over torch.distributed, with a timeout on
every wait and errors that name the peer and the action. The device follows the process
group's backend (CPU for gloo, the current CUDA device for NCCL): one code path for both."""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

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


class PeerError(RuntimeError):
    """A message did not arrive (timeout) or its peer went away."""


@dataclass
class Pending:
    """Posted receives or sends of one message. `arrival` is set for a watched receive."""

    works: list
    tensors: list[torch.Tensor]
    peer: int
    action: str
    arrival: "Arrival | None" = None


@dataclass
class Arrival:
    """When a watched receive completed (`time.perf_counter()`), or the error its wait raised."""

    done: threading.Event = field(default_factory=threading.Event)
    time: float | None = None
    error: BaseException | None = None
    timed_out: bool = False


class ArrivalWatch:
    """Waits for posted receives on helper threads, so that the runner can ask whether a message
    has arrived without blocking: gloo's `Work` has no such test (`is_completed()` turns true
    only inside `wait()`), and a wait with a short timeout aborts the process group. Each
    receive gets its own waiting thread (idle ones are reused), so a message never waits on
    another; the threads are daemons and hold no Python lock while they wait."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def watch(self, works: list) -> Arrival:
        arrival = Arrival()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="zbcompile-arrivals", daemon=True).start()
        jobs.put((works, arrival))
        return arrival

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            works, arrival = jobs.get()
            try:
                for work in works:
                    if work.wait(self.timeout) is False:
                        arrival.timed_out = True
            except RuntimeError as error:
                arrival.error = error
            arrival.time = time.perf_counter()
            with self._lock:
                self._idle.append(jobs)
            arrival.done.set()


class Transport:
    """Sends and receives the tensors of one message (several tensors to one peer are posted as
    one batch). Every wait gives up after `timeout` and raises a PeerError naming the peer rank
    and the action that was waiting. A receive posted with `watch=True` can be asked whether it
    has `arrived()` without blocking."""

    def __init__(self, rank: int, timeout: timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        self._sends: list[Pending] = []

    @functools.cached_property
    def matches_by_tag(self) -> bool:
        """gloo pairs a send with its receive by tag; NCCL (and the others) by order per peer."""
        return dist.get_backend() == "gloo"

    @functools.cached_property
    def _watch(self) -> ArrivalWatch | None:
        """Helper threads for `arrived()` where the backend's works cannot be tested without
        blocking (gloo); None where `Work.is_completed()` answers (NCCL)."""
        return ArrivalWatch(self.timeout) if dist.get_backend() == "gloo" else None

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False) -> Pending:
        pending = Pending(self._post(dist.irecv, buffers, peer, tag, action), list(buffers), peer, action)
        if watch and self._watch is not None:
            pending.arrival = self._watch.watch(pending.works)
        return pending

    def arrived(self, pending: Pending) -> bool:
        """Whether `pending` (a receive) has completed, without blocking. Always False for a gloo
        receive posted without `watch=True`."""
        if pending.arrival is not None:
            return pending.arrival.done.is_set()
        if self._watch is not None:
            return False
        return all(work.is_completed() for work in pending.works)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        tensors = [t.contiguous() for t in tensors]
        self._sends.append(Pending(self._post(dist.isend, tensors, peer, tag, action), tensors, peer, action))

    def wait(self, pending: Pending, waiting_action: str) -> list[torch.Tensor]:
        action = f"{waiting_action} (waiting for {pending.action})"
        if pending.arrival is not None:
            self._wait_watched(pending.arrival, pending.peer, action)
            return pending.tensors
        for work in pending.works:
            self._wait_one(work, pending.peer, action)
        return pending.tensors

    def _wait_watched(self, arrival: Arrival, peer: int, action: str) -> None:
        # the helper thread's own wait gives up after `timeout`; this one only backs it up
        if not arrival.done.wait(self.timeout.total_seconds() + 30):
            arrival.timed_out = True
        if arrival.error is not None:
            raise self._peer_failed(peer, action, arrival.error) from arrival.error
        if arrival.timed_out:
            raise self._timed_out(peer, action)

    def flush_sends(self) -> None:
        """Wait for every send posted so far (their tensors can then be freed)."""
        sends, self._sends = self._sends, []
        for pending in sends:
            for work in pending.works:
                self._wait_one(work, pending.peer, pending.action)

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
