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
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zbcompile.runtime.parallel.grad_reduction import REDUCE
from zbcompile.runtime.parallel.layout import from_first_rank, gather_objects
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.tuning.contest import Entrant
from zbcompile.runtime.tuning.schedule_trial import ScheduleSwitch
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

    def exchange(peer: int, send_first: bool) -> None:
        for op in (dist.isend, dist.irecv) if send_first else (dist.irecv, dist.isend):
            op(buffer, peer, group=layout.pp_group).wait(timeout)

    samples = []
    for _ in range(repeats):
        for sender in (0, 1):  # pairs (0,1), (2,3)... then (1,2), (3,4)...
            if (position - sender) % 2 == 0 and position + 1 < len(ranks):
                started = time.perf_counter()
                exchange(ranks[position + 1], send_first=True)
                samples.append((time.perf_counter() - started) / 2)
            elif (position - sender) % 2 == 1 and position >= 1:
                exchange(ranks[position - 1], send_first=False)
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
            share = 0.5
            if isinstance(static.w, (list, tuple)):
                share = static.w[stage] / max(static.i[stage] + static.w[stage], 1e-12)
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

    `static` are the compiler's estimates (memory, and how a fused backward splits).
    `reduction`: per compiled stage, its gradient reduction over the replicas in boundary
    messages (`grad_reduction.reduction_per_message`; empty or zeros without replicas): measured
    costs carry it as a reduction time (`costs.with_reduction` on the measured message time), so
    solves, predictions and the drift check count each stage's reduction after its last W, and a
    measured step lasts until this rank's last reduction ends. `solve_arguments`, `recompute` and
    `trial_rounds`: how a solved schedule comes in (`switch`, a `schedule_trial.ScheduleSwitch`)."""

    def __init__(
        self, profile_steps: int, solve_arguments: Callable[[Costs], dict[str, Any]], static: Costs,
        recompute: Any = None, reduction: Sequence[float] = (), trial_rounds: int = 0,
    ) -> None:
        self.profile_steps, self.static, self.reduction = profile_steps, static, tuple(reduction)
        self.measured: Costs | None = None  # the costs of the latest solve
        self.predicted_span: float | None = None  # of the running schedule, under `measured`
        self.reference: float | None = None  # measured / predicted span right after the switch
        self.resolves = 0  # solves started, the first included
        self.drift_resolves = 0
        self.history: list[dict[str, Any]] = []  # one entry per decision, for people
        self.switch = ScheduleSwitch(solve_arguments, recompute, self.reduction, trial_rounds, self.history)
        self._steps = 0
        self._window: list[Timeline] = []  # per step, its actions and its gradient reductions

    @property
    def solving(self) -> bool:
        """A solve has started and its outcome is not kept or rejected yet (the same on every rank)."""
        return self.switch.under_way

    @property
    def settled(self) -> bool:
        """A schedule chosen with measured costs runs (raced at compile or switched in) and no
        solve is under way: what a benchmark's warm-up waits for."""
        return self.measured is not None and not self.solving

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
        self.history = self.switch.history = list(state["history"])
        self.reference, self._steps, self._window = None, 0, []
        self.switch.forget()

    def calibrated(self, costs: Costs, schedule: Schedule, event: str, finalists: Sequence[Entrant] = ()) -> None:
        """The running `schedule` was solved at compile with `costs` measured by calibration steps
        (`runtime/tuning/recut.py`): from here on, drift checks against them, as after a first
        measurement's switch. `finalists`: the compile's race entrants still in at its end, the
        running one first, tried on training steps first (`ScheduleSwitch.try_finalists`)."""
        self._use(0, schedule, with_reduction(costs, self.reduction), event)
        self.switch.try_finalists(finalists, self.measured)

    def after_step(self, runner: DistributedRunner) -> Schedule | None:
        """Record the step `runner` just ran; returns the schedule to run from the next step on,
        when this step is a switch (the same on every rank), else None."""
        step, self._steps = self._steps, self._steps + 1
        if step == 0:
            return None  # the first step warms up (allocator, caches): not representative
        if self.switch.under_way:
            self._window.clear()  # the old schedule's steps tell nothing about the new one
            schedule, kept = self.switch.after_step(runner, step)
            if kept is not None:
                if self.switch.recompute is not None:  # the estimates of the levels kept
                    self.static = runner.compiled.schedule_costs()
                self._use(step, *kept)
            return schedule
        self._window.append([*at_traced_sizes(runner), *filter(_is_reduction, runner.comm_timeline)])
        window = (
            self.profile_steps if self.measured is None else min(DRIFT_WINDOW << self.drift_resolves, MAX_DRIFT_WINDOW)
        )
        if len(self._window) >= window:
            self._check(runner, step)
        return None

    def _check(self, runner: DistributedRunner, step: int) -> None:
        """End of a window: gather its numbers; solve with them at first, or on drift."""
        costs, span = _window_costs(self._window, runner, self.static, self.reduction)
        self._window = []
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
        self.switch.solve(costs, runner.layout.decides)
        self.resolves += 1
        self.history.append({"step": step, "event": f"solving ({reason})", "measured_span_s": span})

    def _use(self, step: int, schedule: Schedule, costs: Costs, event: str, trial: dict | None = None) -> None:
        """From here on `schedule` runs, its drift checked against its prediction under `costs`."""
        self.measured, self.predicted_span, self.reference = costs, simulate(schedule, costs).span, None
        entry = {"step": step, "event": event, "predicted_span_s": self.predicted_span}
        self.history.append({**entry, "trial": trial} if trial is not None else entry)


def _window_costs(window: list[Timeline], runner: DistributedRunner, static: Costs, reduction: tuple) -> tuple:
    """The costs (with `reduction`) and the step (the longest rank's median span) of a window of
    steps, the first pipeline's on every rank (one gather: all run one schedule)."""
    local = (
        action_medians([[e for e in t if not _is_reduction(e)] for t in window]),
        statistics.median(_span(t) for t in window),
        round_trip_seconds(runner),
    )
    gathered = from_first_rank(gather_objects(local, runner.layout.pp_group), runner.layout)
    measured = costs_of([g[0] for g in gathered], max(g[2] for g in gathered), runner.schedule.stages, static)
    return with_reduction(measured, reduction), max(g[1] for g in gathered)


def at_traced_sizes(runner: DistributedRunner) -> Timeline:
    """The step's compute timeline, each action's time divided by how much more work its sizes
    are than the example its compile was traced with (`CompiledPipeline.work_scales`): a
    shape-generic compile's steps of every length measure costs at one length, the one its
    static costs and schedule are for."""
    if not runner.sizes:  # a compile of one shape
        return runner.timeline
    scales = runner.compiled.work_scales(runner.sizes)
    timeline = []
    for text, start, end in runner.timeline:
        action = Action.parse(text)
        timeline.append((text, start, start + (end - start) / scales.get((action.stage, action.kind.name), 1.0)))
    return timeline


def _is_reduction(entry: tuple[Any, float, float]) -> bool:
    return isinstance(entry[0], str) and entry[0].startswith(REDUCE)


def _span(timeline: Timeline) -> float:
    """First start to last end of one rank's actions and gradient reductions in a step."""
    return max(e for _, _, e in timeline) - min(s for _, s, _ in timeline) if timeline else 0.0
