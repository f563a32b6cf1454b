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

from .costs import StageCosts
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


def improve(
    schedule: Schedule,
    costs: StageCosts,
    limits: Sequence[float] | None,
    objective: str,
    time_budget: float,
    deterministic: bool = False,
    workers: int | None = None,
) -> SolveResult:
    """Search for a better ordering within ``time_budget`` seconds (wall time, model building included)."""
    started = time.perf_counter()
    baseline = simulate(schedule, costs).objective(objective)
    unchanged = SolveResult(schedule, baseline, 0.0, {"status": "heuristic", "solver_time_s": 0.0})
    if time_budget <= 0.2:
        return unchanged
    from ortools.sat.python import cp_model  # slow import: only when solving

    S, M = schedule.stages, schedule.microbatches
    stage_to_rank = schedule.stage_to_rank
    longest = max([costs.comm] + [costs.duration(s, k) for s in range(S) for k in "FIW"])
    if longest <= 0:
        return unchanged
    scale = _DURATION_SCALE / longest

    def ticks(x: float) -> int:
        return int(math.floor(x * scale + 1e-9))

    comm = ticks(costs.comm)
    dur = {(s, k): ticks(costs.duration(s, k)) for s in range(S) for k in "FIW"}

    def delay(a: int, b: int) -> int:
        return comm if stage_to_rank[a] != stage_to_rank[b] else 0

    rows = schedule.compute_only().actions
    hint = asap_timing(rows, S, stage_to_rank, lambda a: dur[(a.stage, a.kind)], comm)
    hint_end = int(max(hint.end.values()))
    first_f = [0] * S
    for s in range(1, S):
        first_f[s] = first_f[s - 1] + dur[(s - 1, "F")] + delay(s - 1, s)
    horizon = hint_end if objective == "makespan" else 2 * hint_end

    model = cp_model.CpModel()
    start, end, interval = {}, {}, {}
    for a in (a for row in rows for a in row):
        d = dur[(a.stage, a.kind)]
        st = model.new_int_var(first_f[a.stage], horizon - d, f"s{a}")
        start[a], end[a] = st, st + d
        interval[a] = model.new_fixed_size_interval_var(st, d, f"i{a}")
        model.add_hint(st, int(hint.start[a]))
    skipped = SolveResult(schedule, baseline, 0.0, {"status": "skipped (budget spent building the model)"})

    def out_of_time() -> bool:  # (a work-based stop only when deterministic)
        return not deterministic and time.perf_counter() - started > 0.6 * time_budget

    for s in range(S):
        if out_of_time():
            return skipped
        for k in range(M):
            f, i, w = Action(s, "F", k), Action(s, "I", k), Action(s, "W", k)
            model.add(start[i] >= end[f])
            model.add(start[w] >= end[i])
            if s > 0:
                model.add(start[f] >= end[Action(s - 1, "F", k)] + delay(s - 1, s))
            if s < S - 1:
                model.add(start[i] >= end[Action(s + 1, "I", k)] + delay(s + 1, s))
            if k > 0:
                for kind in "FIW":
                    model.add(start[Action(s, kind, k)] >= end[Action(s, kind, k - 1)])
    memory_values = list(costs.mem_f) + list(costs.mem_w) + (list(limits) if limits is not None else [])
    mem_scale, memory_exact = _memory_scale(memory_values)
    for rank, row in enumerate(rows):
        if out_of_time():
            return skipped
        model.add_no_overlap([interval[a] for a in row])
        if limits is not None and math.isfinite(limits[rank]):
            # Memory as a cumulative resource (see the module docstring): per microbatch, amounts
            # held from one event to another, all non-negative whether I frees or adds memory.
            holds, demands = [], []
            for a in row:
                if a.kind != "F":
                    continue
                s, k = a.stage, a.microbatch
                mf, mw = costs.mem_f[s], costs.mem_w[s]
                i_act, w_act = Action(s, "I", k), Action(s, "W", k)
                if mw <= mf:
                    spans = ((a, i_act, mf - mw), (a, w_act, mw))
                else:
                    spans = ((a, w_act, mf), (i_act, w_act, mw - mf))
                for since, until, amount in spans:
                    demand = int(round(amount * mem_scale))
                    if demand <= 0:
                        continue
                    begin = start[since] if since.kind == "F" else end[since]
                    hint_begin = hint.start[since] if since.kind == "F" else hint.end[since]
                    finish = end[until]
                    size = model.new_int_var(0, horizon, f"hold{since}{until}")
                    model.add_hint(size, int(hint.end[until] - hint_begin))
                    holds.append(model.new_interval_var(begin, size, finish, f"h{since}{until}"))
                    demands.append(demand)
            if holds:
                model.add_cumulative(holds, demands, int(math.floor(limits[rank] * mem_scale + 1e-6)))
    last_w = [end[Action(s, "W", M - 1)] for s in range(S)]
    obj = model.new_int_var(0, horizon, "objective")
    if objective == "makespan":
        for e in last_w:
            model.add(obj >= e)
        hint_value = hint_end
    else:
        for s in range(S):
            model.add(start[Action(s, "F", 0)] == first_f[s])
            model.add(obj >= last_w[s] - first_f[s])
        hint_value = max(int(hint.end[Action(s, "W", M - 1)]) - first_f[s] for s in range(S))
    model.add(obj <= hint_value)
    model.add_hint(obj, hint_value)
    model.minimize(obj)

    solver = cp_model.CpSolver()
    # CP-SAT overshoots its limit a little, and checking its answer takes time too: keep a margin
    margin = max(0.3, 0.15 * time_budget)
    remaining = time_budget - (time.perf_counter() - started) - margin
    if remaining <= 0.1:
        return skipped
    params = solver.parameters
    params.random_seed = 0
    if deterministic:
        params.num_workers = 1
        params.max_deterministic_time = remaining
        params.max_time_in_seconds = 10 * remaining
    else:
        params.num_workers = workers or 2
        params.max_time_in_seconds = remaining
    status = solver.solve(model)
    status_name = solver.status_name(status)
    info = {"status": status_name, "solver_time_s": time.perf_counter() - started}
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(schedule, baseline, 0.0, info)
    slack = 2 * S if objective == "span" else 0
    bound = max(0.0, (solver.best_objective_bound - slack) / scale) if memory_exact else 0.0
    order = [
        tuple(sorted(row, key=lambda a: (solver.value(start[a]), solver.value(end[a]), _KIND_ORDER[a.kind], a.microbatch)))
        for row in rows
    ]
    candidate = Schedule(schedule.name, S, M, stage_to_rank, tuple(order), dict(schedule.info))
    try:
        validate(candidate, costs, limits, check_lowering=False)
    except ValueError:
        return SolveResult(schedule, baseline, bound, {**info, "status": f"{status_name} (solution rejected)"})
    value = simulate(candidate, costs).objective(objective)
    if value >= baseline:
        return SolveResult(schedule, baseline, bound, info)
    return SolveResult(candidate, value, bound, info)
