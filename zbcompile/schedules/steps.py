"""Several training steps back to back: with an end-of-step barrier (a global all-reduce of the
gradient norm before the optimizer) or with optimizer post-validation (no barrier).

Each step runs the schedule's compute actions with the timing rules of ``timing`` (every
action as early as its rank and inputs allow, ``comm`` on cross-rank edges); then per rank an
optimizer step of ``optimizer`` time. What differs is how steps connect:

- ``"barrier"``: when the last rank has finished the step, an all-reduce of ``allreduce`` time
  (default ``2 * comm * ceil(log2(ranks))``, a latency-bound small message) completes on every
  rank; then every rank steps its optimizer and starts the next step. The step time is the
  makespan plus the all-reduce plus the optimizer.
- ``"post-validation"``: the partial norm travels last -> 0: rank r steps its optimizer once its
  own last action is done and rank r+1's partial has arrived (``comm`` after rank r+1 added its
  own). The global state travels 0 -> last at the start of the next step: rank r starts step
  i+1 when its optimizer is done and rank r-1 has started step i+1 (plus ``comm``). Rollbacks
  are rare and not modelled.

The steady-state step time is the mean interval between consecutive steps' ends over the
second half of the simulated steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .costs import Costs, ResolvedCosts, resolve_costs
from .ir import Action, Schedule
from .render import Box
from .timing import ScheduleError, backward_index, dependencies

MODES = ("barrier", "post-validation")


@dataclass(frozen=True)
class StepsResult:
    """Timing of `steps` back-to-back steps: `step_time` (steady state), `step_ends[i]` (when
    the last rank finished step i, optimizer included) and every box (compute actions, the
    all-reduce "AR" and the optimizer "OPT") for the renderer."""

    mode: str
    step_time: float
    step_ends: tuple[float, ...]
    boxes: tuple[Box, ...]


def _time_step(
    rows: Sequence[Sequence[Action]], schedule: Schedule, sc: ResolvedCosts, free_at: Sequence[float]
) -> tuple[dict[Action, float], dict[Action, float]]:
    """ASAP timing of one step whose ranks become free at `free_at`."""
    backward_of = backward_index(rows)
    position, clock = [0] * len(rows), list(free_at)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while position[r] < len(row):
                action = row[position[r]]
                deps = dependencies(action, schedule.stages, schedule.stage_to_rank, sc.comm, backward_of)
                if any(d.action not in end for d in deps):
                    break
                start[action] = max([clock[r]] + [end[d.action] + d.delay for d in deps])
                end[action] = clock[r] = start[action] + sc.duration(action.stage, action.kind)
                position[r] += 1
                progress = True
    stuck = [f"rank {r} at {row[position[r]]}" for r, row in enumerate(rows) if position[r] < len(row)]
    if stuck:
        raise ScheduleError(f"schedule cannot run to completion: {', '.join(stuck)}")
    return start, end


def simulate_steps(
    schedule: Schedule, costs: Costs | ResolvedCosts | None = None, mode: str = "post-validation", steps: int = 6,
    optimizer: float = 0.0, allreduce: float | None = None,
) -> StepsResult:
    """`steps` steps of `schedule` back to back, connected as `mode` says (see the module)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an int >= 2 (the steady state needs consecutive steps), got {steps!r}")
    sc = resolve_costs(costs, schedule.stages)
    rows = [tuple(a for a in row if a.is_compute) for row in schedule.actions]
    ranks = len(rows)
    if allreduce is None:
        allreduce = 2 * sc.comm * math.ceil(math.log2(ranks)) if ranks > 1 else 0.0
    free_at = [0.0] * ranks
    boxes: list[Box] = []
    step_ends = []
    for step in range(steps):
        start, end = _time_step(rows, schedule, sc, free_at)
        boxes += [
            Box(r, start[a], end[a], str(a.microbatch), a.kind, f"step{step}:{a}")
            for r, row in enumerate(rows)
            for a in row
        ]
        last = [max((end[a] for a in row), default=free_at[r]) for r, row in enumerate(rows)]
        if mode == "barrier":
            synced = max(last) + allreduce
            opt_start = [synced] * ranks
            boxes += [Box(r, last[r], synced, "", "AR", f"step{step}:allreduce") for r in range(ranks)]
        else:
            opt_start = [0.0] * ranks
            for r in reversed(range(ranks)):  # the partial state: last -> 0
                opt_start[r] = last[r] if r == ranks - 1 else max(last[r], opt_start[r + 1] + sc.comm)
        done = [t + optimizer for t in opt_start]
        boxes += [
            Box(r, opt_start[r], done[r], "", "OPT", f"step{step}:optimizer") for r in range(ranks) if optimizer > 0
        ]
        step_ends.append(max(done))
        if mode == "barrier":
            free_at = done
        else:
            free_at = [0.0] * ranks
            for r in range(ranks):  # the global state: 0 -> last, before each rank's next step
                free_at[r] = done[r] if r == 0 else max(done[r], free_at[r - 1] + sc.comm)
    half = steps // 2
    step_time = (step_ends[-1] - step_ends[half - 1]) / (steps - half)
    return StepsResult(mode, step_time, tuple(step_ends), tuple(boxes))


def compare_step_times(
    schedule: Schedule, costs: Costs | ResolvedCosts | None = None, steps: int = 6, optimizer: float = 0.0,
    allreduce: float | None = None,
) -> dict[str, StepsResult]:
    """Both modes under the same costs: {"barrier": ..., "post-validation": ...}."""
    return {mode: simulate_steps(schedule, costs, mode, steps, optimizer, allreduce) for mode in MODES}
