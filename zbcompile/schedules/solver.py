"""Exact/anytime improvement of a schedule with OR-Tools CP-SAT, warm-started from it.

Model (times scaled to integers, durations rounded down so the proven bound stays valid):
- one fixed-size interval per compute action;
- precedences: F(s-1,k) -> F(s,k), I(s+1,k) -> I(s,k) with the comm delay across ranks,
  F(s,k) -> I(s,k) -> W(s,k), and F, I, W each in microbatch order on their stage;
- no overlap per rank; memory as a cumulative resource per rank under the limit. A microbatch
  holds M_B - M_W from its F's start to its I's end and M_W from its F's start to its W's end when
  M_W <= M_B; when M_W > M_B (I raises memory) it holds M_B from its F's start to its W's end and
  M_W - M_B from its I's end to its W's end. Every demand is non-negative either way, and the level
  after each action is the simulator's running sum (the peak right after an I included);
- objective "makespan": the last end; "span": the longest per-rank span, with every rank's first F
  pinned at the time the first forward reaches it (that is when the runtime starts it).
The solution's per-rank order is re-timed by the simulator with the real costs; the caller keeps
whichever of the start schedule and the solution is better. The bound is CP-SAT's proven
objective bound, converted back to real units (minus the rounding slack).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .costs import ResolvedCosts
from .ir import Action, Schedule
from .simulate import simulate
from .timing import asap_timing
from .validate import validate

_KIND_ORDER = {"F": 0, "I": 1, "W": 2}
_DURATION_SCALE = 10_000  # the longest action becomes this many integer time units
_MAX_MEMORY_SCALE = 1024


@dataclass(frozen=True)
class SolveResult:
    schedule: Schedule
    value: float
    lower_bound: float
    info: dict[str, Any] = field(default_factory=dict)


def _memory_scale(values: Sequence[float]) -> tuple[int, bool]:
    """Smallest power-of-two scale that makes all memory values integers (exact), else 1000."""
    scale = 1
    while scale <= _MAX_MEMORY_SCALE:
        if all(abs(v * scale - round(v * scale)) < 1e-9 for v in values):
            return scale, True
        scale *= 2
    return 1000, False


class _Model:
    """The CP-SAT model of ``schedule``'s compute actions (see the module docstring): times in
    integer ticks, ``scale`` ticks per unit, durations rounded down; warm-started from the
    schedule's own timing. Built in steps that the caller may stop between."""

    def __init__(self, cp_model, schedule: Schedule, costs: ResolvedCosts, scale: float, objective: str):
        S = schedule.stages
        self.schedule, self.costs, self.scale, self.objective = schedule, costs, scale, objective
        self.comm = self.ticks(costs.comm)
        self.dur = {(s, k): self.ticks(costs.duration(s, k)) for s in range(S) for k in "FIW"}
        self.rows = schedule.compute_only().actions
        self.hint = asap_timing(self.rows, S, schedule.stage_to_rank, lambda a: self.dur[(a.stage, a.kind)], self.comm)
        self.hint_end = int(max(self.hint.end.values()))
        self.first_f = [0] * S  # when the first forward reaches each stage (the runtime starts it then)
        for s in range(1, S):
            self.first_f[s] = self.first_f[s - 1] + self.dur[(s - 1, "F")] + self.delay(s - 1, s)
        self.horizon = self.hint_end if objective == "makespan" else 2 * self.hint_end
        self.model = cp_model.CpModel()
        self.start, self.end, self.interval = {}, {}, {}

    def ticks(self, x: float) -> int:
        return int(math.floor(x * self.scale + 1e-9))

    def delay(self, a: int, b: int) -> int:
        stage_to_rank = self.schedule.stage_to_rank
        return self.comm if stage_to_rank[a] != stage_to_rank[b] else 0

    def add_actions(self) -> None:
        """One fixed-size interval per action, hinted with its start in the schedule's timing."""
        model = self.model
        for a in (a for row in self.rows for a in row):
            d = self.dur[(a.stage, a.kind)]
            st = model.new_int_var(self.first_f[a.stage], self.horizon - d, f"s{a}")
            self.start[a], self.end[a] = st, st + d
            self.interval[a] = model.new_fixed_size_interval_var(st, d, f"i{a}")
            model.add_hint(st, int(self.hint.start[a]))

    def add_stage_precedences(self, s: int) -> None:
        """Stage ``s``'s dependencies and its microbatch order of F, I and W."""
        model, start, end, S = self.model, self.start, self.end, self.schedule.stages
        for k in range(self.schedule.microbatches):
            f, i, w = Action(s, "F", k), Action(s, "I", k), Action(s, "W", k)
            model.add(start[i] >= end[f])
            model.add(start[w] >= end[i])
            if s > 0:
                model.add(start[f] >= end[Action(s - 1, "F", k)] + self.delay(s - 1, s))
            if s < S - 1:
                model.add(start[i] >= end[Action(s + 1, "I", k)] + self.delay(s + 1, s))
            if k > 0:
                for kind in "FIW":
                    model.add(start[Action(s, kind, k)] >= end[Action(s, kind, k - 1)])

    def add_rank(self, rank: int, limit: float | None, mem_scale: int) -> None:
        """No overlap on ``rank``; under a finite ``limit``, its memory as a cumulative resource:
        per microbatch, amounts held from one event to another, all non-negative whether I frees
        or adds memory (see the module docstring)."""
        model, costs, hint = self.model, self.costs, self.hint
        row = self.rows[rank]
        model.add_no_overlap([self.interval[a] for a in row])
        if limit is None or not math.isfinite(limit):
            return
        holds, demands = [], []
        for a in row:
            if a.kind != "F":
                continue
            s, k = a.stage, a.microbatch
            mf, mw = costs.mem_b[s], costs.mem_w[s]
            i_act, w_act = Action(s, "I", k), Action(s, "W", k)
            if mw <= mf:
                spans = ((a, i_act, mf - mw), (a, w_act, mw))
            else:
                spans = ((a, w_act, mf), (i_act, w_act, mw - mf))
            for since, until, amount in spans:
                demand = int(round(amount * mem_scale))
                if demand <= 0:
                    continue
                begin = self.start[since] if since.kind == "F" else self.end[since]
                hint_begin = hint.start[since] if since.kind == "F" else hint.end[since]
                size = model.new_int_var(0, self.horizon, f"hold{since}{until}")
                model.add_hint(size, int(hint.end[until] - hint_begin))
                holds.append(model.new_interval_var(begin, size, self.end[until], f"h{since}{until}"))
                demands.append(demand)
        if holds:
            model.add_cumulative(holds, demands, int(math.floor(limit * mem_scale + 1e-6)))

    def add_objective(self) -> None:
        """Minimise the last end ("makespan") or the longest rank span from each rank's pinned
        first F ("span"); the schedule's own value bounds it and is the hint."""
        model, S, M = self.model, self.schedule.stages, self.schedule.microbatches
        last_w = [self.end[Action(s, "W", M - 1)] for s in range(S)]
        obj = model.new_int_var(0, self.horizon, "objective")
        if self.objective == "makespan":
            for e in last_w:
                model.add(obj >= e)
            hint_value = self.hint_end
        else:
            for s in range(S):
                model.add(self.start[Action(s, "F", 0)] == self.first_f[s])
                model.add(obj >= last_w[s] - self.first_f[s])
            hint_value = max(int(self.hint.end[Action(s, "W", M - 1)]) - self.first_f[s] for s in range(S))
        model.add(obj <= hint_value)
        model.add_hint(obj, hint_value)
        model.minimize(obj)

    def order(self, solver) -> Schedule:
        """The schedule whose per-rank order is the solution's start order."""
        start, end = self.start, self.end
        order = [
            tuple(
                sorted(
                    row, key=lambda a: (solver.value(start[a]), solver.value(end[a]), _KIND_ORDER[a.kind], a.microbatch)
                )
            )
            for row in self.rows
        ]
        s = self.schedule
        return Schedule(s.name, s.stages, s.microbatches, s.stage_to_rank, tuple(order), dict(s.info))


def improve(
    schedule: Schedule, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str, time_budget: float,
    deterministic: bool = False, workers: int | None = None,
) -> SolveResult:
    """Search for a better ordering within ``time_budget`` seconds (wall time, model building
    included): build the model, solve it, re-time the solution's order with the real costs."""
    started = time.perf_counter()
    baseline = simulate(schedule, costs).objective(objective)
    unchanged = SolveResult(schedule, baseline, 0.0, {"status": "heuristic", "solver_time_s": 0.0})
    if time_budget <= 0.2:
        return unchanged
    from ortools.sat.python import cp_model  # slow import: only when solving

    S = schedule.stages
    longest = max([costs.comm] + [costs.duration(s, k) for s in range(S) for k in "FIW"])
    if longest <= 0:
        return unchanged
    m = _Model(cp_model, schedule, costs, _DURATION_SCALE / longest, objective)
    m.add_actions()
    skipped = SolveResult(schedule, baseline, 0.0, {"status": "skipped (budget spent building the model)"})

    def out_of_time() -> bool:  # (a work-based stop only when deterministic)
        return not deterministic and time.perf_counter() - started > 0.6 * time_budget

    for s in range(S):
        if out_of_time():
            return skipped
        m.add_stage_precedences(s)
    memory_values = list(costs.mem_b) + list(costs.mem_w) + (list(limits) if limits is not None else [])
    mem_scale, memory_exact = _memory_scale(memory_values)
    for rank in range(len(m.rows)):
        if out_of_time():
            return skipped
        m.add_rank(rank, limits[rank] if limits is not None else None, mem_scale)
    m.add_objective()

    solver = cp_model.CpSolver()
    # CP-SAT overshoots its limit a little, and checking its answer takes time too: keep a margin
    margin = max(0.3, 0.15 * time_budget)
    remaining = time_budget - (time.perf_counter() - started) - margin
    if remaining <= 0.1:
        return skipped
    _set_limits(solver.parameters, remaining, deterministic, workers)
    status = solver.solve(m.model)
    status_name = solver.status_name(status)
    info = {"status": status_name, "solver_time_s": time.perf_counter() - started}
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(schedule, baseline, 0.0, info)
    slack = 2 * S if objective == "span" else 0
    bound = max(0.0, (solver.best_objective_bound - slack) / m.scale) if memory_exact else 0.0
    candidate = m.order(solver)
    try:
        validate(candidate, costs, limits, check_lowering=False)
    except ValueError:
        return SolveResult(schedule, baseline, bound, {**info, "status": f"{status_name} (solution rejected)"})
    value = simulate(candidate, costs).objective(objective)
    if value >= baseline:
        return SolveResult(schedule, baseline, bound, info)
    return SolveResult(candidate, value, bound, info)


def _set_limits(params, seconds: float, deterministic: bool, workers: int | None) -> None:
    """Seed 0; deterministic: one worker and ``seconds`` of deterministic time; else ``workers``
    (default 2) for ``seconds`` of wall time."""
    params.random_seed = 0
    if deterministic:
        params.num_workers = 1
        params.max_deterministic_time = seconds
        params.max_time_in_seconds = 10 * seconds
    else:
        params.num_workers = workers or 2
        params.max_time_in_seconds = seconds
