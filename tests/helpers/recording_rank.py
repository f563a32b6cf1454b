"""One rank's step through the runtime's own interpreter (`runtime/dispatch.Interpreter`) without
processes: stages that record what they compute and transports that record what is posted, so
that tests see the order the interpreter runs, posts and waits in.

    RecordingStage, RecordingTransport   a log of computations, sends and receives, in order
    LogicalClock, TimedStage             computations that last a fixed logical time
    LateTransport                        messages that arrive at fixed logical times
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

NAMES = ("x",)  # what every message carries
LAYOUT = (torch.Size([2]), torch.float32)


class RecordingTransport:
    """A `MessageTransport` that records, in order, every receive the interpreter posts and every
    send it makes, as (kind, peer, action). The peers are not run: a wait hands back zeros of
    the message's layout, and no message is ever known to have arrived (so no W moves into a
    wait)."""

    def __init__(self, matches_by_tag: bool, log: list[tuple[str, int, str]]) -> None:
        self.matches_by_tag = matches_by_tag
        self.log = log

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False):
        self.log.append(("recv", peer, action))
        return [torch.zeros(b.shape, dtype=b.dtype) for b in buffers]

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        self.log.append(("send", peer, action))

    def can_tell(self, pending) -> bool:
        return False

    def arrived(self, pending) -> bool:
        return False

    def wait(self, pending, waiting_action: str) -> list[torch.Tensor]:
        return pending

    def arrival_time(self, pending) -> float | None:
        return None

    def complete_messages(self) -> None:
        pass


class RecordingStage:
    """Stands in for a StageExecutor: records its computation in the same log as the transport,
    returns values of the message's names (the loss on the last stage)."""

    def __init__(self, stage: int, last: int, log: list[tuple[str, int, str]]) -> None:
        self.stage, self.last, self.log = stage, last, log

    def _ran(self, kind: str, microbatch: int) -> dict[str, torch.Tensor]:
        self.log.append(("compute", -1, f"{self.stage}{kind}{microbatch}"))
        return {name: torch.zeros(LAYOUT[0]) for name in NAMES}

    def forward(self, microbatch: int, feed) -> dict[str, torch.Tensor]:
        values = self._ran("F", microbatch)
        return {"loss": torch.zeros(())} if self.stage == self.last else values

    def input_backward(self, microbatch: int, grads) -> dict[str, torch.Tensor]:
        return self._ran("I", microbatch)

    def backward(self, microbatch: int, grads) -> dict[str, torch.Tensor]:
        return self._ran("B", microbatch)

    def weight_backward(self, microbatch: int) -> None:
        self._ran("W", microbatch)


class LogicalClock:
    """An `ActionClock` on logical seconds: time moves only when a `TimedStage` computes or a
    `LateTransport` wait lasts until its message arrives. Every step starts at 0."""

    on_host = True

    def __init__(self) -> None:
        self.now = 0.0
        self._intervals: dict[str, list[tuple[Any, float, float]]] = defaultdict(list)

    def start_step(self) -> None:
        self.now = 0.0
        self._intervals = defaultdict(list)

    def mark(self) -> float:
        return self.now

    def record(self, timeline: str, label: Any, started: float, ended: float | None = None) -> None:
        self._intervals[timeline].append((label, started, self.now if ended is None else ended))

    def seconds_since(self, mark: float) -> float:
        return self.now - mark

    def end_step(self, timeout_s: float) -> dict[str, list[tuple[Any, float, float]]]:
        intervals, self._intervals = self._intervals, defaultdict(list)
        return intervals


class TimedStage(RecordingStage):
    """A `RecordingStage` whose computations last `seconds[kind]` on `clock`."""

    def __init__(
        self, stage: int, last: int, log: list[tuple[str, int, str]], clock: LogicalClock, seconds: Mapping[str, float]
    ) -> None:
        super().__init__(stage, last, log)
        self.clock, self.seconds = clock, seconds

    def _ran(self, kind: str, microbatch: int) -> dict[str, torch.Tensor]:
        self.clock.now += self.seconds[kind]
        return super()._ran(kind, microbatch)


@dataclass
class _Posted:
    action: str
    buffers: list[torch.Tensor]
    watched: bool


class LateTransport(RecordingTransport):
    """Messages pair by tag (as gloo's) and each RECV's message arrives at `arrivals[action]`
    logical seconds into the step (0: there at once). As the gloo transport, it tells whether a
    receive has arrived only where the interpreter asked it to watch that receive."""

    def __init__(self, clock: LogicalClock, arrivals: Mapping[str, float], log: list[tuple[str, int, str]]) -> None:
        super().__init__(True, log)
        self.clock, self.arrivals = clock, arrivals

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False):
        self.log.append(("recv", peer, action))
        return _Posted(action, [torch.zeros(b.shape, dtype=b.dtype) for b in buffers], watch)

    def can_tell(self, pending: _Posted) -> bool:
        return pending.watched

    def arrived(self, pending: _Posted) -> bool:
        return self.clock.now >= self.arrival_time(pending)

    def wait(self, pending: _Posted, waiting_action: str) -> list[torch.Tensor]:
        self.clock.now = max(self.clock.now, self.arrival_time(pending))  # idle until it is there
        return pending.buffers

    def arrival_time(self, pending: _Posted) -> float:
        return self.arrivals.get(pending.action, 0.0)
