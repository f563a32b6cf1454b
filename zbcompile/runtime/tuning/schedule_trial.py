"""How a schedule solved with measured costs comes in (`ScheduleSwitch`, for `profile.CostTuner`), and
schedules tried on the training's own steps before one is kept (`ScheduleTrial`): a schedule the tuner
solves while training goes on against the running one (the solve's prediction comes from the same
measured costs that may be off by more than the gain it promises), and the finalists of the compile's
race, which timed calibration steps of one batch, few and without the optimizer's step between them.

The entrants alternate over the training's steps, in blocks of two (the first settles the
switch, the second is timed: the time since the previous step ended, on every rank; a step's
time is the longest rank's). A round is one block of each, the order rotated round by round;
after each round one gather over the pipeline. The trial ends as the compile's race does
(`schedule_race.decided`: every timed step of the fastest beat every one of each other's,
after `schedule_race.MIN_ROUNDS`) or after its rounds (at least `MIN_ROUNDS`). Another entrant
replaces the incumbent only on a lead beyond the noise: faster than the incumbent in every round,
each round's two steps compared with each other (the machine's speed drifts between rounds, and
one step's time varies by more than the entrants differ); of several such, the one with the
least median ratio to the incumbent. Else the incumbent stays. Where an entrant brings other
stage programs (recompute levels chosen again), each switch runs that entrant's programs; none
changes what a step computes.
"""

from __future__ import annotations

import statistics
import time  # a solve's age: real time (`perf_counter` is the trial's clock, replaced in tests)
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zbcompile.runtime.parallel.layout import from_first_rank, gather_objects
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.tuning.background_solve import BackgroundSolve
from zbcompile.runtime.tuning.schedule_race import MIN_ROUNDS, Entrant, decided
from zbcompile.schedules import Costs, Schedule, simulate
from zbcompile.schedules.costs import with_reduction

BLOCK_STEPS = 2  # per entrant and round: one settling step, one timed
FINALIST_SWITCHED = "switched to {label}: faster than the race's winner in every round on training steps"
FINALIST_KEPT = "kept {label}: no other finalist was faster in every round on training steps"


class ScheduleTrial:
    """`entrants` in the order their blocks run, the first from the next step on (its caller
    switches it in); `incumbent`, one of them, the one kept without a lead beyond the noise
    (`winner`). Each runs with the stage programs `programs` gives (label -> compiled pipeline;
    absent or None: the runner's own, unchanged). Every rank of the pipeline calls `after_step`
    after each step of the trial."""

    def __init__(
        self, entrants: Sequence[Entrant], incumbent: Entrant, rounds: int, programs: dict[str, Any] | None = None
    ) -> None:
        self.entrants = list(entrants)
        self.incumbent = incumbent
        self.rounds = max(rounds, MIN_ROUNDS)
        self.programs = programs or {}
        self.rounds_run = 0
        self._turn = 0  # the block's place in this round's order
        self._step = 0  # the step's place in its block
        self._mine: dict[str, float] = {}  # this round's timed steps on this rank, by label
        self._last = perf_counter()

    @property
    def running(self) -> Entrant:
        return self.entrants[(self._turn + self.rounds_run) % len(self.entrants)]

    def after_step(self, layout: Any, scale: float = 1.0) -> Entrant | None:
        """Record the step just run (`scale`: how much more work its sizes are than the compile's
        example, `CompiledPipeline.step_scale`; its time counts divided by it); returns the entrant
        to run from the next step on where it changes (None: keep the running one). `finished`
        tells when the trial has ended."""
        now = perf_counter()
        seconds, self._last = (now - self._last) / scale, now
        self._step += 1
        if self._step < BLOCK_STEPS:
            return None
        before = self.running
        self._mine[before.label] = seconds
        self._step, self._turn = 0, self._turn + 1
        if self._turn == len(self.entrants):
            self._end_round(layout)
        after = self.winner if self.finished else self.running
        return after if after is not before else None

    @property
    def finished(self) -> bool:
        return self.rounds_run >= self.rounds or decided(self.entrants, self.rounds_run)

    @property
    def winner(self) -> Entrant:
        """The incumbent, unless another entrant was faster than it in every round run (at least
        `MIN_ROUNDS`): then, of those, the least median ratio of its step to the incumbent's."""
        leads = self._leads()
        return min(leads, key=lambda pair: pair[1])[0] if leads else self.incumbent

    def _leads(self) -> list[tuple[Entrant, float]]:
        """Each entrant faster than the incumbent in every round, with its median ratio to it."""
        base = self.incumbent.samples
        if len(base) < MIN_ROUNDS:
            return []
        leads = []
        for entrant in self.entrants:
            ratios = [mine / theirs for mine, theirs in zip(entrant.samples, base)]
            if entrant is not self.incumbent and len(ratios) == len(base) and max(ratios) < 1:
                leads.append((entrant, statistics.median(ratios)))
        return leads

    def record(self) -> dict[str, Any]:
        """What `explain()` shows: every entrant's predicted and measured steps, the choice and why."""
        winner = self.winner
        if winner is not self.incumbent:
            why = f"faster than {self.incumbent.label} in each of {self.rounds_run} round(s)"
        else:
            why = f"no other was faster than it in each of {self.rounds_run} round(s)"
        return {"entrants": [e.record() for e in self.entrants], "chosen": winner.label, "why": why}

    def _end_round(self, layout: Any) -> None:
        gathered = gather_objects(self._mine, layout.pp_group)
        times = from_first_rank([max(g[e.label] for g in gathered) for e in self.entrants], layout)
        for entrant, seconds in zip(self.entrants, times):
            entrant.samples.append(seconds)
        self._mine, self._turn = {}, 0
        self.rounds_run += 1


@dataclass
class _TrialUnderWay:
    """A trial and what its end records: per entrant (by label), the costs its drift is checked
    against once kept; the events of a switch and of the incumbent kept."""

    trial: ScheduleTrial
    costs: dict[str, Costs]
    switched: str = "switched"
    kept: str = "kept the running schedule: the solved one was not faster in every round"

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
