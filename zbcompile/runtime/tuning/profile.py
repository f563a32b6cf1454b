"""Costs from the real machine, and schedules re-solved with them while training goes on.

Costs: per-stage median times of F, I and W from the runners' timelines, gathered from every
rank of the pipeline, and the time to send a stage's boundary tensors to the next rank (half a
measured round trip).

`CostTuner` (a distributed pipeline's default for zb-auto): after the first (warm-up) step it times
`profile_steps` steps, gathers their costs (one collective), and rank 0 solves the schedule with
them in a child process (`background_solve`) while the steps go on with the old one. After each of
those steps rank 0 broadcasts one number, whether the solver has finished; the step after which it
has is the switch, on every rank, with one broadcast of the new schedule. Under recompute="auto",
rank 0 first chooses the recompute levels again with the measured costs (under the same limit), and
the switch broadcasts them with the schedule: every rank then runs those levels' stage programs.
Before a switch is kept it is tried (`schedule_trial.py`): the new schedule and the running one
alternate over the next steps, and the new one stays only where it was faster in every round; a
schedule rejected so is not solved for again until the step drifts once more. A compile whose
schedule was raced (`calibrated`) first tries the race's finalists the same way, on training steps.
From then on it compares the measured step (the longest rank's span of actions and gradient
reductions, median over a window of steps, gathered) with the simulator's span of the running
schedule under the costs it was solved with: when their ratio moves more than `DRIFT_THRESHOLD` away
from the ratio measured in the first window after the switch, it re-solves with the window's costs.
Windows are `DRIFT_WINDOW` steps long and double after every re-solve the drift caused (up to
`MAX_DRIFT_WINDOW`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zbcompile.runtime.parallel.grad_reduction import REDUCE
from zbcompile.runtime.parallel.layout import from_first_rank, gather_objects
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.tuning.background_solve import BackgroundSolve
from zbcompile.runtime.tuning.schedule_race import Entrant
from zbcompile.runtime.tuning.schedule_trial import ScheduleTrial
from zbcompile.schedules import Action, Costs, Schedule, simulate
from zbcompile.schedules.costs import with_reduction

Timeline = Sequence[tuple[str, float, float]]
Medians = dict[tuple[int, str], float]

DRIFT_THRESHOLD = 0.15
"""Re-solve when measured / predicted step time differs by more than this share from its value
right after the schedule was switched in."""
DRIFT_WINDOW = 20
"""Steps per drift check (one small gather each); doubled after each re-solve drift caused."""
MAX_DRIFT_WINDOW = 320


FINALIST_SWITCHED = "switched to {label}: faster than the race's winner in every round on training steps"
FINALIST_KEPT = "kept {label}: no other finalist was faster in every round on training steps"


@dataclass
class _TrialUnderWay:
    """A trial (`schedule_trial.py`) and what its end records: per entrant (by label), the costs its
    drift is checked against once kept; the events of a switch and of the incumbent kept."""

    trial: ScheduleTrial
    costs: dict[str, Costs]
    switched: str = "switched"
    kept: str = "kept the running schedule: the solved one was not faster in every round"


def action_medians(timelines: Sequence[Timeline]) -> Medians:
    """(stage, kind) -> median seconds over every recorded action of that kind and stage. A fused
    backward B counts as I plus W and is reported under "B"."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for timeline in timelines:
        for text, start, end in timeline:
            action = Action.parse(text)
            samples[(action.stage, action.kind)].append(end - start)
    return {key: statistics.median(values) for key, values in samples.items()}


def host_seconds_per_action(timeline: Timeline, comm_timeline: Sequence[tuple[Any, float, float]]) -> float:
    """The runtime's own time per compute action on this rank (posting messages, bookkeeping, its
    clock), which no action's measured time holds: the median over consecutive actions of the gap
    between them that was not a wait for a message. The median, not the mean, so that a process
    descheduled once by a busy machine does not read as every action's cost."""
    waits = [(s, e) for text, s, e in comm_timeline if isinstance(text, str) and "RECV" in text]
    actions = sorted(timeline, key=lambda e: e[1])
    gaps = []
    for (_, _, previous_end), (_, start, _) in zip(actions, actions[1:]):
        waited = sum(max(0.0, min(start, e) - max(previous_end, s)) for s, e in waits)
        gaps.append(max(0.0, start - previous_end - waited))
    return statistics.median(gaps) if gaps else 0.0


def round_trip_seconds(runner: DistributedRunner, repeats: int = 5) -> float:
    """Half the median round trip of the largest boundary message between this rank and the next
    pipeline rank (every rank takes part: even positions send first). Each message is waited for
    on the host (`Work.wait` with the timeout blocks the host on NCCL too, where a plain
    `dist.send` would only queue the transfer), so the time is the transfer's."""
    layout = runner.layout
    values = runner.compiled.partition.values
    size = max([v.nbytes for v in values.values()] + [4])
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=runner.device)
    position, ranks = layout.pp_rank, layout.pipeline_ranks
    timeout = runner.transport.timeout

    def send(peer: int) -> None:
        dist.isend(buffer, peer, group=layout.pp_group).wait(timeout)

    def receive(peer: int) -> None:
        dist.irecv(buffer, peer, group=layout.pp_group).wait(timeout)

    samples = []
    for _ in range(repeats):
        for sender in (0, 1):  # pairs (0,1), (2,3)... then (1,2), (3,4)...
            if (position - sender) % 2 == 0 and position + 1 < len(ranks):
                started = time.perf_counter()
                send(ranks[position + 1])
                receive(ranks[position + 1])
                samples.append((time.perf_counter() - started) / 2)
            elif (position - sender) % 2 == 1 and position >= 1:
                receive(ranks[position - 1])
                send(ranks[position - 1])
    return statistics.median(samples) if samples else 0.0


def costs_of(parts: Sequence[Medians], comm: float, stages: int, static: Costs) -> Costs:
    """Costs from every rank's action medians (a fused backward split into I and W by the static
    estimates' shares where only it ran; its own time `Costs.b` where it ran, I + W on the
    stages where it did not); memory as in `static`."""
    medians: Medians = {}
    for part in parts:
        medians.update(part)

    def time_of(stage: int, kind: str) -> float:
        if (stage, kind) in medians:
            return medians[(stage, kind)]
        if kind in ("I", "W") and (stage, "B") in medians:  # only fused backwards ran: split by FLOPs
            share = (
                static.w[stage] / max(static.i[stage] + static.w[stage], 1e-12)
                if isinstance(static.w, (list, tuple))
                else 0.5
            )
            return medians[(stage, "B")] * (share if kind == "W" else 1 - share)
        return 0.0

    i = [time_of(s, "I") for s in range(stages)]
    w = [time_of(s, "W") for s in range(stages)]
    fused = any(kind == "B" for _, kind in medians)
    return Costs(
        f=[time_of(s, "F") for s in range(stages)], i=i, w=w, comm=comm, mem_b=static.mem_b, mem_w=static.mem_w,
        b=[medians.get((s, "B"), i[s] + w[s]) for s in range(stages)] if fused else None,
    )


class CostTuner:
    """Measured costs and re-solved schedules for one compiled pipeline (see the module
    docstring). Every rank of the pipeline calls `after_step()` after each step; all of them
    take every decision at the same step, from the same gathered numbers.

    `solve_arguments(costs)` gives `make_schedule`'s keyword arguments for a schedule solved
    with `costs`; `static` are the compiler's estimates (memory, and how a fused backward splits).
    `recompute` (recompute="auto": `auto_recompute.MeasuredRecomputation`): every solve first
    chooses the recompute levels again with the measured costs, on rank 0; the switch takes
    rank 0's levels with its schedule on every rank, whose runner then runs those levels'
    programs (`Runner.use_programs`). `reduction`: per compiled stage, its gradient reduction
    over the replicas in boundary messages (`grad_reduction.reduction_per_message`; empty or
    zeros without replicas): measured costs carry it as a reduction time (`costs.with_reduction`
    on the measured message time), so solves, predictions and the drift check count each stage's
    reduction after its last W, and a measured step lasts until this rank's last reduction ends.
    `trial_rounds`: the most rounds a solved schedule is tried against the running one before
    it is kept (`schedule_trial.py`; 0: switched in untried)."""

    def __init__(
        self,
        profile_steps: int,
        solve_arguments: Callable[[Costs], dict[str, Any]],
        static: Costs,
        recompute: Any = None,
        reduction: Sequence[float] = (),
        trial_rounds: int = 0,
    ) -> None:
        self.profile_steps = profile_steps
        self.trial_rounds = trial_rounds
        self.reduction = tuple(reduction)
        self.solve_arguments = solve_arguments
        self.static = static
        self.recompute = recompute
        self.measured: Costs | None = None  # the costs of the latest solve
        self.predicted_span: float | None = None  # of the running schedule, under `measured`
        self.reference: float | None = None  # measured / predicted span right after the switch
        self.resolves = 0  # solves started, the first included
        self.drift_resolves = 0
        self.history: list[dict[str, Any]] = []  # one entry per decision, for people
        self._steps = 0
        self._window: list[Timeline] = []  # per step, its actions and its gradient reductions
        # the solve under way: rank 0's child process (None elsewhere), the costs and levels it solves
        # for, and the costs measured running the schedule in use
        self._solving: tuple[BackgroundSolve | None, Costs, tuple[int, ...] | None, Costs] | None = None
        self._trial: _TrialUnderWay | None = None

    @property
    def solving(self) -> bool:
        """A solve has started and its outcome is not kept or rejected yet (the same on every rank)."""
        return self._solving is not None or self._trial is not None

    @property
    def settled(self) -> bool:
        """A schedule chosen with measured costs runs (raced at compile or switched in) and no
        solve is under way: what a benchmark's warm-up waits for."""
        return self.measured is not None and not self.solving

    def wait_for_solve(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the solve under way on this rank (rank 0's child
        process) to finish, so that the next step switches whatever the solver's speed; True
        once it has, or where this rank solves nothing."""
        solve = self._solving[0] if self._solving is not None else None
        return solve is None or solve.wait(timeout)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the costs the running schedule was solved with and the
        decisions so far (a solve in flight is not kept: it starts again after a load)."""
        return {
            "measured": self.measured, "predicted_span": self.predicted_span, "resolves": self.resolves,
            "drift_resolves": self.drift_resolves, "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s record: a warm-up step, then drift checks against the
        saved costs (calibrated again on this run's first window), or the first measurement
        where nothing was measured yet."""
        self.measured, self.predicted_span = state["measured"], state["predicted_span"]
        self.resolves, self.drift_resolves = state["resolves"], state["drift_resolves"]
        self.history = list(state["history"])
        self.reference, self._steps, self._window, self._solving, self._trial = None, 0, [], None, None

    def calibrated(self, costs: Costs, schedule: Schedule, event: str, finalists: Sequence[Entrant] = ()) -> None:
        """The running `schedule` was solved at compile with `costs` measured by calibration steps
        (`runtime/tuning/recut.py`): from here on, drift checks against them, as after a first
        measurement's switch. `finalists`: the compile's race entrants still in at its end, the
        running one first; where there are several and `trial_rounds` allows, they are tried on
        the training's steps first (`schedule_trial.py`): another replaces the running one only
        where it was faster than it in every round."""
        self.measured = with_reduction(costs, self.reduction)
        self.predicted_span = simulate(schedule, self.measured).span
        self.reference = None
        self.history.append({"step": 0, "event": event, "predicted_span_s": self.predicted_span})
        if self.trial_rounds > 0 and len(finalists) > 1:
            entrants = [replace(e, samples=[]) for e in finalists]
            labels = [e.label for e in entrants]
            trial = ScheduleTrial(entrants, entrants[0], self.trial_rounds)
            self._trial = _TrialUnderWay(trial, dict.fromkeys(labels, self.measured), FINALIST_SWITCHED, FINALIST_KEPT)
            event = f"trying the race's finalists on training steps: {', '.join(labels)}"
            self.history.append({"step": 0, "event": event})

    def after_step(self, runner: DistributedRunner) -> Schedule | None:
        """Record the step `runner` just ran; returns the schedule to run from the next step on,
        when this step is a switch (the same on every rank), else None."""
        step, self._steps = self._steps, self._steps + 1
        if step == 0:
            return None  # the first step warms up (allocator, caches): not representative
        if self._trial is not None:
            return self._tried(runner, step)
        self._window.append([*runner.timeline, *_reductions(runner.comm_timeline)])
        if self._solving is not None:
            return self._switch_if_solved(runner, step)
        window = (
            self.profile_steps if self.measured is None else min(DRIFT_WINDOW << self.drift_resolves, MAX_DRIFT_WINDOW)
        )
        if len(self._window) < window:
            return None
        self._check(runner, step)
        return None

    def _check(self, runner: DistributedRunner, step: int) -> None:
        """End of a window: gather its numbers; solve with them at first, or on drift."""
        local = (
            action_medians([[e for e in t if not _is_reduction(e)] for t in self._window]),
            statistics.median(_span(t) for t in self._window),
            round_trip_seconds(runner),
        )
        # every rank decides on the first pipeline's numbers: all run one schedule
        gathered = from_first_rank(gather_objects(local, runner.layout.pp_group), runner.layout)
        self._window = []
        measured = costs_of([g[0] for g in gathered], max(g[2] for g in gathered), runner.schedule.stages, self.static)
        costs = with_reduction(measured, self.reduction)
        span = max(g[1] for g in gathered)
        reason = "first measurement"
        if self.measured is not None:
            ratio = span / max(self.predicted_span, 1e-12)
            if self.reference is None:
                self.reference = ratio
                self.history.append({"step": step, "event": "calibrated", "measured_span_s": span, "ratio": ratio})
                return
            drift = ratio / self.reference - 1
            if abs(drift) <= DRIFT_THRESHOLD:
                return
            self.drift_resolves += 1
            reason = f"drift {drift:+.0%}"
        levels, solve, running = None, None, costs
        if runner.layout.decides:
            levels, costs = self._recompute_levels(costs)
            solve = BackgroundSolve(self.solve_arguments(costs))
        self._solving = (solve, costs, levels, running)
        self.resolves += 1
        self.history.append({"step": step, "event": f"solving ({reason})", "measured_span_s": span})

    def _recompute_levels(self, measured: Costs) -> tuple[tuple[int, ...] | None, Costs]:
        """With `recompute`: the levels chosen with `measured` and their costs (the running
        levels where none fits the limit under them); else (None, `measured`)."""
        if self.recompute is None:
            return None, measured
        try:
            levels, costs = self.recompute.choose(measured)
        except ValueError:
            return self.recompute.levels, measured
        return levels, with_reduction(costs, self.reduction)

    def _switch_if_solved(self, runner: DistributedRunner, step: int) -> Schedule | None:
        """While rank 0 solves: one broadcast per step says whether it has finished (or given up
        after the pipeline's timeout); the step after which it has is the switch, everywhere: to
        the solved schedule for good, or for a trial against the running one."""
        solve, costs, levels, running = self._solving
        self._window.clear()  # the old schedule's steps tell nothing about the new one
        limit = runner.transport.timeout.total_seconds()
        finished = solve is None or solve.done() or time.perf_counter() - solve.started > limit
        for group in runner.layout.decision_groups:
            flag = torch.tensor([int(finished)], device=runner.device)
            dist.broadcast(flag, group=group, group_src=0)
            finished = bool(flag.item())
        if not finished:
            return None
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
            return None
        schedule = schedule.with_info(cost_source="measured")
        incumbent = runner.compiled
        if levels is not None:
            before = self.recompute.levels
            runner.use_programs(self.recompute.use(levels))
            self.history.append(
                {"step": step, "event": f"recompute levels {list(before)} -> {list(levels)} (measured costs)"}
            )
        if self.trial_rounds == 0 or (runner.compiled is incumbent and schedule.actions == runner.schedule.actions):
            self._use(runner, schedule, costs, step, "switched")  # untried, or nothing to try: the same actions
            return schedule
        programs = {"solved": runner.compiled, "running": incumbent}
        follows = runner.follow_readiness
        candidate = Entrant("solved", schedule, simulate(schedule, costs).span, follows)
        held = Entrant("running", runner.schedule, simulate(runner.schedule, running).span, follows)
        trial = ScheduleTrial([candidate, held], held, self.trial_rounds, programs)
        self._trial = _TrialUnderWay(trial, {"solved": costs, "running": running})
        self.history.append({"step": step, "event": "trying the solved schedule against the running one"})
        return schedule

    def _tried(self, runner: DistributedRunner, step: int) -> Schedule | None:
        """A step of the trial under way: the schedule to run next where it changes; at its end
        the winner stays, with the costs it was measured or solved with."""
        under_way = self._trial
        trial = under_way.trial
        entrant = trial.after_step(runner.layout)
        if entrant is not None:
            programs = trial.programs.get(entrant.label)
            if programs is not None and programs is not runner.compiled:
                runner.use_programs(programs)
            runner.follow(entrant.follow_readiness)
        if not trial.finished:
            return entrant.schedule if entrant is not None else None
        self._trial, self._window = None, []
        winner = trial.winner
        if self.recompute is not None:
            self.recompute.running = runner.compiled
        event = (under_way.kept if winner is trial.incumbent else under_way.switched).format(label=winner.label)
        self._use(runner, winner.schedule, under_way.costs[winner.label], step, event, trial.record())
        return entrant.schedule if entrant is not None else None

    def _use(
        self, runner: DistributedRunner, schedule: Schedule, costs: Costs, step: int, event: str,
        trial: dict[str, Any] | None = None,
    ) -> None:
        """From here on `schedule` runs, its drift checked against its prediction under `costs`."""
        self.static = runner.compiled.schedule_costs() if self.recompute is not None else self.static
        self.measured = costs
        self.predicted_span = simulate(schedule, costs).span
        self.reference = None
        entry = {"step": step, "event": event, "predicted_span_s": self.predicted_span}
        self.history.append({**entry, "trial": trial} if trial is not None else entry)


def _is_reduction(entry: tuple[Any, float, float]) -> bool:
    return isinstance(entry[0], str) and entry[0].startswith(REDUCE)


def _reductions(comm_timeline: Sequence[tuple[Any, float, float]]) -> list[tuple[Any, float, float]]:
    """A step's gradient reductions (posted, waited for) among its communication intervals."""
    return [e for e in comm_timeline if _is_reduction(e)]


def _span(timeline: Timeline) -> float:
    """First start to last end of one rank's actions and gradient reductions in a step."""
    return max(e for _, _, e in timeline) - min(s for _, s, _ in timeline) if timeline else 0.0
