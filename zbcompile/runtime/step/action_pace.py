"""How long a rank's actions and messages take beyond their own work: testing and rehearsal aids
(`PipelineOptions._slowdown`, `PipelineOptions._emulate`; `zbcompile/rehearsal/rehearse.py`).

- `Slowed(factor)`: every F, I, W and B sleeps `factor - 1` times its own time after it ran, as a
  slower or shared device would.
- `Emulated(times)`: every F, I, W and B of stage s lasts exactly `times.seconds(s, kind)`: the real
  computation runs, then the action waits out the rest inside its own measured interval (an
  action whose computation takes longer keeps its own time). Every message crossing ranks is
  posted no sooner than `times.link_s` after its sender gave it (`transport.Transport.link_s`, on the
  send thread: the sender goes on meanwhile), so it is handed over no sooner either.

Both act on the host's clock (CPU ranks, gloo): on CUDA the host does not wait for the device, so
a host sleep would not lengthen the action."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from zbcompile.schedules import Action
from zbcompile.schedules.costs import EmulatedTimes


class ActionPace(Protocol):
    """What the interpreter calls after each computation, `taken_s` seconds after it started:
    waits as long as the action should still last."""

    def wait(self, action: Action, taken_s: float) -> None: ...


@dataclass(frozen=True)
class Slowed:
    """Each computation takes `factor` times its own time."""

    factor: float

    def wait(self, action: Action, taken_s: float) -> None:
        time.sleep((self.factor - 1.0) * taken_s)


class Emulated:
    """Each computation lasts its emulated time (or its own, where that is longer). A sleep wakes
    late by the scheduler's latency (about 0.1 ms, more on busy cores), so each sleep is cut short
    by the lateness seen so far (`late_s`, a running mean), which keeps actions at their time on
    average instead of each one longer."""

    def __init__(self, times: EmulatedTimes) -> None:
        self.times = times
        self.late_s = 0.0

    def wait(self, action: Action, taken_s: float) -> None:
        deadline = time.perf_counter() + self.times.seconds(action.stage, action.kind.value) - taken_s
        left = deadline - time.perf_counter() - self.late_s
        if left > 0:
            time.sleep(left)
            self.late_s = min(max(0.0, self.late_s + 0.25 * (time.perf_counter() - deadline)), 1e-3)


def install(
    interpreter: Any, rank: int, stages: int, slowdown: Mapping[int, float] | None, emulate: EmulatedTimes | None
) -> None:
    """Pace `interpreter` (global rank `rank`'s, running a schedule of `stages` stages or chunks)
    as the options say: emulated times (and their link) where given, else this rank's slowdown."""
    if emulate is not None:
        if emulate.stages != stages:
            raise ValueError(
                f"pipeline(_emulate=...): the emulated times are for {emulate.stages} stages, but rank {rank}'s "
                f"schedule runs {stages} (chunks of a multi-chunk schedule count); give one time per stage"
            )
        interpreter.pace = Emulated(emulate)
        interpreter.transport.link_s = emulate.link_s
    elif (slowdown or {}).get(rank, 1.0) > 1.0:
        interpreter.pace = Slowed(float(slowdown[rank]))
