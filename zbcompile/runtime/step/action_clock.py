"""When the actions of a step ran, measured where they run. The interpreter (`runtime/step/dispatch.py`)
marks a point before an action and records the action's interval after it; the step's intervals
are read once, at the end of the step.

- `HostClock` (CPU): an action has finished when its call returns, so a mark is
  `time.perf_counter()`.
- `EventClock` (CUDA): a call only queues the action's kernels, so a mark is an event recorded on
  the current (compute) stream. Nothing waits for the device inside the step; `end_step` waits for
  the step's last event alone (not for the whole device: NCCL's stream may still hold receives
  posted for the next step's start) and turns the events into seconds on the host's
  `perf_counter()` scale, from an event recorded when the step started.

Both give, per step, lists of (label, start, end) in seconds by timeline name. The CUDA calls sit
behind `event_type` (a class with `record()`, `query()`, `synchronize()`, `elapsed_time(other)` in
milliseconds, as `torch.cuda.Event`), which a CPU test substitutes."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Protocol

Intervals = dict[str, list[tuple[Any, float, float]]]


class ActionClock(Protocol):
    """What the interpreter needs of a clock. `on_host`: marks are host times, read at once."""

    on_host: bool

    def start_step(self) -> None: ...

    def mark(self) -> Any: ...

    def record(self, timeline: str, label: Any, started: Any, ended: Any = None) -> None: ...

    def seconds_since(self, mark: Any) -> float: ...

    def end_step(self, timeout_s: float) -> Intervals: ...


class HostClock:
    """Marks are `time.perf_counter()` seconds: right where the work runs on the host's thread."""

    on_host = True

    def __init__(self) -> None:
        self._intervals: Intervals = defaultdict(list)

    def start_step(self) -> None:
        self._intervals = defaultdict(list)

    def mark(self) -> float:
        return time.perf_counter()

    def record(self, timeline: str, label: Any, started: float, ended: float | None = None) -> None:
        """An interval from `started` to `ended` (default: now) under `timeline`."""
        self._intervals[timeline].append((label, started, time.perf_counter() if ended is None else ended))

    def seconds_since(self, mark: float) -> float:
        return time.perf_counter() - mark

    def end_step(self, timeout_s: float) -> Intervals:
        intervals, self._intervals = self._intervals, defaultdict(list)
        return intervals


def cuda_event() -> Any:
    """A CUDA timing event (recorded on the current stream by `record()`)."""
    import torch

    return torch.cuda.Event(enable_timing=True)


def wait_for_event(event: Any, timeout_s: float, what: str) -> None:
    """Wait for `event` alone (polled, so that the wait has a timeout; never the whole device)."""
    deadline = time.perf_counter() + timeout_s
    while not event.query():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the device did not finish {what} within {timeout_s:.0f} s")
        time.sleep(0.0002)


class EventClock:
    """Marks are timing events recorded on the current stream (`event_type()`, then `record()`);
    read at the end of the step. `seconds_since` cannot tell device time on the host: it answers
    0 (the interpreter then counts the work it queued itself)."""

    on_host = False

    def __init__(self, event_type: Callable[[], Any] = cuda_event) -> None:
        self.event_type = event_type
        self._pending: list[tuple[str, Any, Any, Any]] = []
        self._origin: Any = None
        self._origin_host = 0.0

    def start_step(self) -> None:
        self._pending = []
        self._origin = self.mark()
        self._origin_host = time.perf_counter()

    def mark(self) -> Any:
        event = self.event_type()
        event.record()
        return event

    def record(self, timeline: str, label: Any, started: Any, ended: Any = None) -> None:
        self._pending.append((timeline, label, started, self.mark() if ended is None else ended))

    def seconds_since(self, mark: Any) -> float:
        return 0.0

    def end_step(self, timeout_s: float) -> Intervals:
        """Wait (at most `timeout_s`) for the step's last event, then read every interval."""
        wait_for_event(self.mark(), timeout_s, "the step's work")
        origin, base = self._origin, self._origin_host
        intervals: Intervals = defaultdict(list)
        for timeline, label, started, ended in self._pending:
            start, end = (base + origin.elapsed_time(event) / 1e3 for event in (started, ended))
            intervals[timeline].append((label, start, end))
        self._pending = []
        return intervals
