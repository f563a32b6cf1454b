"""Point-to-point messages between pipeline ranks over torch.distributed, with a timeout on
every wait and errors that name the peer and the action. The device follows the process
group's backend (CPU for gloo, the current CUDA device for NCCL): one code path for both.

A message is one buffer (`flat_message`), sent with one isend and received with one irecv on
the pipeline's own process group. On NCCL, waiting for a receive makes the compute stream wait
for it, not the host; the step's end confirms, on the host and with the timeout, every message
of the step. A sent buffer is released as soon as its send has completed (on NCCL, seen when
the next message is posted or waited for; gloo cannot tell without waiting, so there at the
step's end), and counted until then (`sending_bytes`, `peak_sending_bytes`).

The helper threads of gloo transports stop when a transport is collected (each once idle) and
are joined at interpreter exit (`stop_helper_threads`, also run by `runtime/build.py`'s exit
hook), while Python still runs: a thread that is in C++ code (gloo's `wait()`, or freeing a
message's Work and buffer) when Python finalizes is killed there, which aborts the process
("terminate called without an active exception"). An idle helper thread holds no message, and
a receive still unanswered after a short grace at exit (a step that failed) is woken by
aborting the transport's process group."""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from zbcompile.measure import sleep_until
from zbcompile.runtime.parallel.layout import device_for
from zbcompile.runtime.step import flat_message


class MessageTransport(Protocol):
    """What the step interpreter (`runtime/step/dispatch.py`) uses of a transport: `Transport` between
    ranks, `local.InProcessTransport` between the stages of one process. A receive is posted
    with its buffers and returns a handle that `wait` turns into the received tensors."""

    matches_by_tag: bool

    def post_recv(
        self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False
    ) -> Any: ...

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None: ...

    def can_tell(self, pending: Any) -> bool: ...

    def arrived(self, pending: Any) -> bool: ...

    def wait(self, pending: Any, waiting_action: str) -> list[torch.Tensor]: ...

    def arrival_time(self, pending: Any) -> float | None: ...

    def complete_messages(self) -> None: ...


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
    nbytes: int = 0

    def complete(self, action: str, rank: int, timeout: timedelta) -> None:
        """Wait until the message completed (for its watching thread, else its posting thread, then
        its works); raise a PeerError (`rank`'s, in `action`) where one failed or passed `timeout`."""
        # a helper thread's own wait gives up after `timeout`; these only back it up
        event = self.done or self.posted
        if event is not None and not event.wait(timeout.total_seconds() + 30):
            self.timed_out = True
        error, timed_out = self.error, self.timed_out
        for work in self.works if self.done is None and error is None and not timed_out else ():
            try:
                timed_out = work.wait(timeout) is False
            except RuntimeError as failure:
                error = failure
            if error is not None or timed_out:
                break
        if error is None and not timed_out:
            return
        after = f"after {timeout.total_seconds():.0f} s"
        if error is not None:
            raise PeerError(
                f"rank {rank}: {action} failed on its message with rank {self.peer} "
                f"(peer rank {self.peer} may have died or timed out {after}): {str(error).splitlines()[0]}"
            ) from error
        raise PeerError(f"rank {rank}: timed out {after} in {action} waiting for peer rank {self.peer}")


class _Poster:
    """A thread that posts sends in the order they are given. gloo's `isend` can block the
    calling thread for milliseconds while the process computes (it waits for gloo's own network
    thread, which competes for the cores), so the runner's thread hands sends over here and goes
    on computing. With gloo, messages are paired by tag, so posting on another thread cannot
    change what a peer sees. (Receives stay on the runner's thread: posted there they cost
    less, once arrived, than a handover would.)"""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def post(self, pending: Pending, post: Callable[[], list], not_before: float = 0.0) -> None:
        """Post `pending` by calling `post()`, after the sends given before it and no sooner than
        `not_before` (a `time.perf_counter()`)."""
        pending.posted = threading.Event()
        self._jobs.put((pending, post, not_before))

    def stop(self) -> None:
        """End the thread once it has posted what it was given."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            pending, post, not_before = job
            sleep_until(not_before)
            try:
                pending.works = post()
            except RuntimeError as error:
                pending.error = error
            pending.posted.set()
            del job, pending, post  # an idle helper thread holds no message (see the module docstring)


class _Watch:
    """Threads that wait for posted gloo receives, so that the runner can learn without blocking
    whether a message has arrived: gloo's `Work` has no such test (`is_completed()` turns true
    only inside `wait()`), and a wait with a short timeout aborts the process group. Each
    receive gets a thread of its own (idle ones are reused), so a message never waits on
    another. The threads are daemons and hold no Python lock while they wait; `stop()` ends
    them (see the module docstring)."""

    def __init__(self, timeout: timedelta, group: dist.ProcessGroup | None) -> None:
        self.timeout = timeout
        self.group = group if group is not None else dist.group.WORLD  # kept: it may be destroyed by exit
        self._idle: list[queue.SimpleQueue] = []
        self._threads: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self._waiting: set[int] = set()  # ids of the receives a thread is waiting for
        self._lock = threading.Lock()

    def watch(self, pending: Pending) -> None:
        """Wait for the posted receive `pending` on a thread of its own."""
        pending.done = threading.Event()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            self._waiting.add(id(pending))
        if jobs is None:
            jobs = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(jobs,), name="zbcompile-arrival", daemon=True)
            self._threads.append((thread, jobs))
            thread.start()
        jobs.put(pending)

    def stop(self, grace_s: float, abort: bool) -> None:
        """End every thread once it is idle. With `abort` (at exit): give the receives still
        awaited `grace_s` seconds to arrive, then abort the process group to wake the threads
        still inside gloo's wait, and join them."""
        deadline = time.perf_counter() + grace_s
        while abort and self._waiting and time.perf_counter() < deadline:
            time.sleep(0.01)
        if abort and self._waiting:
            _abort(self.group)
        for _, jobs in self._threads:
            jobs.put(None)
        if abort:
            for thread, _ in self._threads:
                thread.join(grace_s)

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (pending := jobs.get()) is not None:
            try:
                pending.timed_out = any([work.wait(self.timeout) is False for work in pending.works])
            except RuntimeError as error:
                pending.error = error
            pending.arrived_at = time.perf_counter()
            with self._lock:
                self._idle.append(jobs)
                self._waiting.discard(id(pending))
            pending.done.set()
            del pending  # an idle helper thread holds no message (see the module docstring)

    def threads(self) -> list[threading.Thread]:
        return [thread for thread, _ in self._threads]


def _abort(group: dist.ProcessGroup | None) -> None:
    """Abort `group` (even one `destroy_process_group` has let go of), ignoring its errors: the
    process is leaving."""
    try:
        if group is not None:
            group.abort()
    except (RuntimeError, ValueError, AttributeError):
        pass


_RUNNING: set[_Helpers] = set()  # the helpers whose threads have not been joined
EXIT_GRACE_S = 5.0  # how long a receive still awaited at exit may take before the group is aborted


class _Helpers:
    """The helper threads of a gloo transport: `poster` posts its sends, `watch` waits for its
    watched receives. They stop when the transport is collected, each once idle (listed until
    they have ended, so that exit still joins them), or at exit, now (see `_Watch.stop`), joined."""

    def __init__(self, transport: Transport) -> None:
        _RUNNING.difference_update([h for h in _RUNNING if h.ended()])  # collected transports' threads
        self.poster = _Poster("zbcompile-send")
        self.watch = _Watch(transport.timeout, transport.group)
        _RUNNING.add(self)
        weakref.finalize(transport, self.stop, False)

    def stop(self, at_exit: bool) -> None:
        self.poster.stop()
        self.watch.stop(EXIT_GRACE_S, abort=at_exit)
        if at_exit:
            self.poster.thread.join(EXIT_GRACE_S)
            _RUNNING.discard(self)

    def ended(self) -> bool:
        return not any(thread.is_alive() for thread in [self.poster.thread, *self.watch.threads()])


@atexit.register
def stop_helper_threads() -> None:
    """Stop and join every transport's helper threads (at interpreter exit, before Python
    finalizes; no transport may send or receive afterwards)."""
    for helpers in list(_RUNNING):
        helpers.stop(at_exit=True)


class Transport:
    """Sends and receives the messages of one rank over `group` (the pipeline's process group;
    None: the default group), each message one flat buffer (`flat_message`). Every wait gives up
    after `timeout` and raises a PeerError naming the peer rank and the action that was
    waiting. With gloo, a helper thread posts the sends (`_Poster`), and `arrived()` tells
    without blocking whether a receive posted with `watch=True` has completed (a thread waits
    for it, `_Watch`); NCCL's messages are confirmed on the host by `complete_messages`."""

    def __init__(self, rank: int, timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.timeout = timeout
        self.group = group
        self.sending_bytes = 0  # bytes of sent buffers whose send has not been seen complete
        self.peak_sending_bytes = 0
        self._sends: deque[Pending] = deque()
        self._device_waited: list[Pending] = []  # NCCL receives the compute stream waits for
        # a rehearsal's link time (`runtime/step/action_pace.py`): each send is posted no sooner than this
        # many seconds after it is given (on the poster thread; without one, on the caller's)
        self.link_s = 0.0

    @functools.cached_property
    def matches_by_tag(self) -> bool:
        """gloo pairs a send with its receive by tag; NCCL (and the others) by order per peer."""
        return dist.get_backend(self.group) == "gloo"

    @functools.cached_property
    def device(self) -> torch.device:
        return device_for(self.group)

    @functools.cached_property
    def _helpers(self) -> _Helpers | None:
        """The helper threads where messages pair by tag (posting on another thread cannot reorder
        what a peer sees) and works cannot be tested without blocking: gloo; None elsewhere."""
        return _Helpers(self) if self.matches_by_tag else None

    def post_recv(
        self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False
    ) -> Pending:
        """Receive a message shaped like `buffers`: one tensor is received into; several only
        give the layout of the flat buffer received into (`torch.empty(..., device="meta")`
        allocates nothing), and `wait` returns copies of its parts (each freed at its own last use)."""
        layouts = [(b.shape, b.dtype) for b in buffers]
        flat = buffers[0] if len(buffers) == 1 else flat_message.empty(layouts, self.device)
        works = self._post(dist.irecv, flat, peer, tag, action)
        pending = Pending(works, flat_message.unpack(flat, layouts), peer, action)
        if watch and self._helpers is not None:
            self._helpers.watch.watch(pending)
        return pending

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        self._release_sent()
        flat = flat_message.pack(tensors)
        pending = Pending([], [flat], peer, action, nbytes=flat.numel() * flat.element_size())
        post = functools.partial(self._post, dist.isend, flat, peer, tag, action)
        not_before = time.perf_counter() + self.link_s if self.link_s else 0.0
        if self._helpers is None:
            sleep_until(not_before)
            pending.works = post()
        else:
            self._helpers.poster.post(pending, post, not_before)
        self._sends.append(pending)
        self.sending_bytes += pending.nbytes
        self.peak_sending_bytes = max(self.peak_sending_bytes, self.sending_bytes)

    def can_tell(self, pending: Pending) -> bool:
        """Whether `arrived(pending)` can tell: NCCL's works can; a gloo receive only if watched."""
        return pending.done is not None or not self.matches_by_tag

    def arrived(self, pending: Pending) -> bool:
        """Whether `pending` (a receive) has completed, without blocking (see `can_tell`)."""
        if pending.done is not None:
            return pending.done.is_set()
        return not self.matches_by_tag and all(work.is_completed() for work in pending.works)

    def wait(self, pending: Pending, waiting_action: str) -> list[torch.Tensor]:
        """The received tensors, for the work queued next: on gloo once they are there; on NCCL
        at once, the current stream waiting for them (confirmed by `complete_messages`)."""
        waiting = f"{waiting_action} (waiting for {pending.action})"
        if self.matches_by_tag:
            pending.complete(waiting, self.rank, self.timeout)
        else:
            for work in pending.works:
                work.wait()  # no timeout: the current stream waits, the host goes on
            self._device_waited.append(Pending(pending.works, [], pending.peer, waiting))
            self._release_sent()
        tensors, pending.tensors = pending.tensors, []
        if len(tensors) > 1:  # out of the flat buffer (after its wait, on the stream that waited):
            tensors = [t.clone() for t in tensors]  # each freed at its own last use, as the memory model counts
        return tensors

    def arrival_time(self, pending: Pending) -> float | None:
        """When a completed receive arrived (`time.perf_counter()`), where a helper thread saw it."""
        return pending.arrived_at

    def complete_messages(self) -> None:
        """Wait until every send posted so far and every receive handed to the device has
        completed (their buffers are then free), each within the timeout."""
        sends, self._sends = self._sends, deque()
        received, self._device_waited = self._device_waited, []
        for pending in [*sends, *received]:
            pending.complete(pending.action, self.rank, self.timeout)
        self.sending_bytes -= sum(p.nbytes for p in sends)

    def _release_sent(self) -> None:
        """Drop the sends seen complete, oldest first (NCCL runs them in the order posted, so the
        first one still running ends the look); gloo cannot tell without waiting."""
        if self.matches_by_tag:
            return
        sends = self._sends
        while sends and all(w.is_completed() for w in sends[0].works):
            self.sending_bytes -= sends.popleft().nbytes

    def _post(self, op, flat: torch.Tensor, peer: int, tag: int, action: str) -> list:
        """Post `op` (dist.isend or dist.irecv) of one message's buffer on the transport's group."""
        try:
            return [op(flat, peer, group=self.group, tag=tag)]
        except RuntimeError as error:
            raise PeerError(f"rank {self.rank}: posting {action} to/from rank {peer} failed: {error}") from error
