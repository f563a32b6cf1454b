"""How long a rank's actions and messages take beyond their own work: testing and rehearsal aids
(`PipelineOptions._slowdown`, `PipelineOptions._emulate`; `zbcompile/rehearsal/rehearse.py`).

- `Slowed(factor)`: every F, I, W and B sleeps `factor - 1` times its own time after it ran, as a
  slower or shared device would.
- `Emulated(times)`: every F, I, W and B of stage s lasts exactly `times.seconds(s, kind)`: the real
  computation runs, then the action waits out the rest inside its own measured interval (an
  action whose computation takes longer keeps its own time). Every message crossing ranks is
  posted no sooner than `times.link_s` after its sender gave it (`transport.Transport.link_s`, on the
  send thread: the sender goes on meanwhile), so it is handed over no sooner either. Where
  `times` give stage s a gradient reduction (`costs.reduce`) and the pipeline has no replicas,
  `EmulatedReduction` stands in for them: each stage's reduction is posted when its gradients
  are final, as `GradReduction` posts (`ReductionPlan.order`), waits for the rank's link to finish
  the reductions posted before it, occupies the link (not the compute) for `times.reduce_s(s)`,
  and the step's gradients are returned only once the last has ended. The link is this rank's
  alone, the replicas taken to run in step: the semantics `schedules/simulate.py` prices.

Both act on the host's clock (CPU ranks, gloo): on CUDA the host does not wait for the device, so
a host sleep would not lengthen the action."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from zbcompile.runtime.parallel.grad_reduction import REDUCE, ReductionPlan
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


class EmulatedReduction:
    """One step's gradient reductions over emulated replicas (module docstring), following `plan`
    (this rank's program's), stage s's lasting `seconds[s]`. The interface of `GradReduction`
    that the runner drives: `ran(stage)` after every W and B, `finish()` once the step's actions
    have run. `timeline` holds ("REDUCE <stage>", start on the link, end) per stage, in
    `time.perf_counter()` seconds."""

    def __init__(self, plan: ReductionPlan, seconds: Sequence[float]) -> None:
        self.plan, self.seconds = plan, tuple(seconds)
        self.timeline: list[tuple[str, float, float]] = []
        self._ran: dict[int, int] = {}
        self._next = 0  # position in plan.order of the next stage to post
        self._link_free = 0.0  # when the link has finished the reductions posted so far

    def ran(self, stage: int) -> None:
        """A W or B of `stage` ran: post the stages whose gradients are now final, in plan order."""
        self._ran[stage] = self._ran.get(stage, 0) + 1
        for ready in self.plan.ready(self._ran, self._next):
            start = max(time.perf_counter(), self._link_free)
            self._link_free = start + self.seconds[ready]
            self.timeline.append((f"{REDUCE} {ready}", start, self._link_free))
            self._next += 1

    def finish(self) -> dict:
        """Wait until the last reduction has ended; no gradient changes (the replicas are emulated)."""
        self.plan.check_posted(self._ran, self._next)
        left = self._link_free - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return {}


def install(
    runner: Any, rank: int, stages: int, slowdown: Mapping[int, float] | None, emulate: EmulatedTimes | None
) -> None:
    """Pace `runner`'s interpreter (global rank `rank`'s, running a schedule of `stages` stages or
    chunks) as the options say: emulated times (their link, and their gradient reductions:
    `runner.emulated_reduction`, per stage seconds) where given, else this rank's slowdown."""
    interpreter = runner.interpreter
    if emulate is not None:
        if emulate.stages != stages:
            raise ValueError(
                f"pipeline(_emulate=...): the emulated times are for {emulate.stages} stages, but rank {rank}'s "
                f"schedule runs {stages} (chunks of a multi-chunk schedule count); give one time per stage"
            )
        interpreter.pace = Emulated(emulate)
        interpreter.transport.link_s = emulate.link_s
        runner.emulated_reduction = tuple(emulate.reduce_s(s) for s in range(stages))
    elif (slowdown or {}).get(rank, 1.0) > 1.0:
        interpreter.pace = Slowed(float(slowdown[rank]))
