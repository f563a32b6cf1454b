"""How a schedule solved with measured costs comes in (`ScheduleSwitch`, for `profile.CostTuner`): the
solve runs in a child process while training goes on; where it brings a schedule other than the
running one, the two go through the contest on the training's own steps (`contest.ScheduleTrial`:
the solve's prediction comes from the same measured costs that may be off by more than the gain it
promises), as do the race's finalists where the compile's race ended undecided. Where an entrant
brings other stage programs (recompute levels chosen again), each switch runs that entrant's
programs; none changes what a step computes.
"""

from __future__ import annotations

import time  # a solve's age
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zbcompile.runtime.parallel.layout import from_first_rank
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.tuning.background_solve import BackgroundSolve
from zbcompile.runtime.tuning.contest import Entrant, ScheduleTrial
from zbcompile.schedules import Costs, Schedule, simulate
from zbcompile.schedules.costs import with_reduction

FINALIST_SWITCHED = "switched to {label}: the least median step of the race's finalists on training steps"
FINALIST_KEPT = "kept {label}: the least median step of the race's finalists on training steps"


@dataclass
class _TrialUnderWay:
    """A trial and what its end records: per entrant (by label), the costs its drift is checked
    against once kept; the events of a switch and of the incumbent kept."""

    trial: ScheduleTrial
    costs: dict[str, Costs]
    switched: str = "switched"
    kept: str = "kept the running schedule: the solved one's median step was not less on training steps"

    def after_step(self, runner: DistributedRunner, recompute: Any) -> tuple[Schedule | None, tuple | None]:
        """A step of the trial: as `ScheduleSwitch.after_step`, the winner kept at its end."""
        trial = self.trial
        entrant = trial.after_step(runner.layout, runner.compiled.step_scale(runner.sizes) if runner.sizes else 1.0)
        if entrant is not None:
            programs = trial.programs.get(entrant.label)
            if programs is not None and programs is not runner.compiled:
                runner.use_programs(programs)
            runner.follow(entrant.follow_readiness)
        schedule = entrant.schedule if entrant is not None else None
        if not trial.finished:
            return schedule, None
        winner = trial.winner
        if recompute is not None:
            recompute.running = runner.compiled
        event = (self.kept if winner is trial.incumbent else self.switched).format(label=winner.label)
        return schedule, (winner.schedule, self.costs[winner.label], event, trial.record())


class ScheduleSwitch:
    """How the schedules a `profile.CostTuner` solves come in, the same on every rank: `solve`
    starts one (`try_finalists` a trial of the race's), then `after_step` runs after each step
    while `under_way`; decisions are appended to `history`. `solve_arguments(costs)` gives
    `make_schedule`'s keyword arguments for a schedule solved with `costs`. `recompute`:
    recompute="auto"'s `auto_recompute.MeasuredRecomputation`, whose levels each solve chooses
    again on rank 0 and the switch runs on every rank (`Runner.use_programs`); None: the levels
    stay. `reduction`: the tuner's. `trial_rounds`: the most rounds a solved schedule is tried
    against the running one before it is kept (0: switched in untried)."""

    def __init__(
        self, solve_arguments: Callable, recompute: Any, reduction: tuple, trial_rounds: int, history: list
    ) -> None:
        self.solve_arguments, self.recompute = solve_arguments, recompute
        self.reduction, self.trial_rounds, self.history = reduction, trial_rounds, history
        # the solve under way: rank 0's child process (None elsewhere), the costs and levels it solves
        # for, and the costs measured running the schedule in use
        self._solving: tuple[BackgroundSolve | None, Costs, tuple[int, ...] | None, Costs] | None = None
        self._trial: _TrialUnderWay | None = None

    @property
    def under_way(self) -> bool:
        return self._solving is not None or self._trial is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the solve under way on this rank (rank 0's child
        process) to finish; True once it has, or where this rank solves nothing."""
        solve = self._solving[0] if self._solving is not None else None
        return solve is None or solve.wait(timeout)

    def forget(self) -> None:
        self._solving = self._trial = None

    def solve(self, measured: Costs, decides: bool) -> None:
        """Solve with `measured` where this rank `decides` (rank 0), in a child process; with
        `recompute`, for the levels chosen with them first (the running ones where none fits)."""
        levels, costs = None, measured
        if decides and self.recompute is not None:
            try:
                levels, costs = self.recompute.choose(measured)
            except ValueError:
                levels = self.recompute.levels
            else:
                costs = with_reduction(costs, self.reduction)
        solve = BackgroundSolve(self.solve_arguments(costs)) if decides else None
        self._solving = (solve, costs, levels, measured)

    def try_finalists(self, finalists: Sequence[Entrant], costs: Costs) -> None:
        """Where there are several `finalists` (the running one first) and `trial_rounds` allows,
        try them on the training's steps, each checked against `costs` once kept."""
        if self.trial_rounds > 0 and len(finalists) > 1:
            entrants = [replace(e, samples=[]) for e in finalists]
            labels = [e.label for e in entrants]
            trial = ScheduleTrial(entrants, entrants[0], self.trial_rounds)
            self._trial = _TrialUnderWay(trial, dict.fromkeys(labels, costs), FINALIST_SWITCHED, FINALIST_KEPT)
            event = f"trying the race's finalists on training steps: {', '.join(labels)}"
            self.history.append({"step": 0, "event": event})

    def after_step(self, runner: DistributedRunner, step: int) -> tuple[Schedule | None, tuple | None]:
        """(the schedule to run from the next step on, None where it does not change; where the way in
        ends, what runs for good: (schedule, the costs its drift is checked against, event, trial
        record or None), else None)."""
        if self._trial is None:
            return self._switch_if_solved(runner, step)
        schedule, kept = self._trial.after_step(runner, self.recompute)
        if kept is not None:
            self._trial = None
        return schedule, kept

    def _switch_if_solved(self, runner: DistributedRunner, step: int) -> tuple[Schedule | None, tuple | None]:
        """One broadcast per step says whether rank 0's solve has finished (or run past the pipeline's
        timeout); the step after which it has switches every rank: for good, or for a trial."""
        solve, costs, levels, running = self._solving
        limit = runner.transport.timeout.total_seconds()
        finished = solve is None or solve.done() or time.perf_counter() - solve.started > limit
        for group in runner.layout.decision_groups:
            flag = torch.tensor([int(finished)], device=runner.device)
            dist.broadcast(flag, group=group, group_src=0)
            finished = bool(flag.item())
        if not finished:
            return None, None
        self._solving = None
        schedule, error = None, None
        if solve is not None:
            try:
                schedule = solve.result(timeout=0.0)
            except RuntimeError as failure:
                error = str(failure)
        schedule, error, levels, costs = from_first_rank((schedule, error, levels, costs), runner.layout)
        if schedule is None:
            self.history.append({"step": step, "event": f"kept the schedule: {error}"})
            return None, None
        schedule = schedule.with_info(cost_source="measured", costs=costs)
        incumbent = runner.compiled
        if levels is not None:
            before = self.recompute.levels
            runner.use_programs(self.recompute.use(levels))
            event = f"recompute levels {list(before)} -> {list(levels)} (measured costs)"
            self.history.append({"step": step, "event": event})
        if self.trial_rounds == 0 or (runner.compiled is incumbent and schedule.actions == runner.schedule.actions):
            return schedule, (schedule, costs, "switched", None)  # untried, or nothing to try: the same actions
        programs = {"solved": runner.compiled, "running": incumbent}
        follows = runner.follow_readiness
        candidate = Entrant("solved", schedule, simulate(schedule, costs).span, follows)
        held = Entrant("running", runner.schedule, simulate(runner.schedule, running).span, follows)
        trial = ScheduleTrial([candidate, held], held, self.trial_rounds, programs)
        self._trial = _TrialUnderWay(trial, {"solved": costs, "running": running})
        self.history.append({"step": step, "event": "trying the solved schedule against the running one"})
        return schedule, None
