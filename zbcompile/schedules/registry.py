"""``make_schedule``: one entry point for every schedule, validated before it is returned."""

from __future__ import annotations

import time
from typing import Sequence, Union

from .costs import Costs, StageCosts, resolve_costs
from .handcrafted import gpipe, interleaved_one_f_one_b, one_f_one_b, zb_h1, zb_h2
from .fastsim import Evaluator
from .heuristic import analytic_lower_bound, zb_auto_candidates, zbv
from .search import search
from .ir import Schedule
from .validate import rank_limits, validate

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv")
OBJECTIVES = ("span", "makespan")
DEFAULT_TIME_BUDGET_S = 3.0
CPSAT_MAX_ACTIONS = 1200  # above this, building the CP-SAT model costs more than it returns

MemoryLimit = Union[None, float, Sequence[float]]


def _check_sizes(name: str, stages: int, microbatches: int) -> None:
    for label, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive int, got {value!r}")
    if name == "zbv" and stages < 2:
        raise ValueError(f"zbv needs at least 2 stages (two chunks per rank), got {stages}")


def _zb_auto(stages, microbatches, sc, limits, objective, time_budget, deterministic, started) -> Schedule:
    """Heuristic, then search (``search.py``), then CP-SAT on small problems, all within the budget.

    The budget counts from ``started`` (the call) and covers everything: heuristic, evaluator,
    search, model building and solving. ``deterministic=True`` replaces wall-clock stops by fixed
    amounts of work derived from the budget (search evaluations, CP-SAT deterministic time).
    """
    budget = DEFAULT_TIME_BUDGET_S if time_budget is None else float(time_budget)
    placement = tuple(range(stages))
    ev = Evaluator(stages, microbatches, placement, sc)
    best_rows, score, source = zb_auto_candidates(stages, microbatches, sc, limits, objective, None, ev)
    heuristic_time = time.perf_counter() - started
    value = score[0]
    bound = analytic_lower_bound(stages, microbatches, placement, sc, objective)
    info = {
        "objective": objective,
        "heuristic_value": value,
        "heuristic_time_s": heuristic_time,
        "value": value,
        "lower_bound": bound,
        "status": "heuristic",
    }

    def left() -> float:
        return budget - (time.perf_counter() - started)

    def at_bound() -> bool:
        return value <= info["lower_bound"] * (1 + 1e-9)

    actions = 3 * stages * microbatches
    use_cpsat = actions <= CPSAT_MAX_ACTIONS
    if budget > 0 and not at_bound() and (deterministic or left() > 0):
        # Keep a margin for turning the result into a Schedule (about one evaluation's time).
        share = 0.7 if use_cpsat else 0.9
        search_budget = left() * share if not deterministic else budget * share
        result = search(ev, limits, objective, search_budget, deterministic, start_rows=best_rows)
        info.update(result.info)
        if result.rows is not None and result.score < score:
            score, best_rows = result.score, result.rows
            value = score[0]
            info["status"] = "search"
        info["value"] = value
    sched = ev.schedule("zb-auto", best_rows, {"heuristic_source": source})
    if budget > 0 and use_cpsat and not at_bound() and (deterministic or left() > 0.3):
        from .solver import improve

        # CP-SAT's presolve does not always stop on time: keep a margin for it and for re-timing.
        solver_budget = budget * 0.25 if deterministic else 0.8 * left() - 0.1
        result = improve(sched, sc, limits, objective, solver_budget, deterministic=deterministic)
        solver_info = dict(result.info)
        info["solver_status"] = solver_info.pop("status")
        info.update(solver_info)
        if info["solver_status"] in ("OPTIMAL", "FEASIBLE"):
            info["status"] = info["solver_status"]
        if result.value < value:
            sched = result.schedule
            value = result.value
            info["value"] = value
        info["lower_bound"] = max(bound, result.lower_bound)
    info["at_lower_bound"] = at_bound()
    return sched.with_info(**info)


def make_schedule(
    name: str,
    stages: int,
    microbatches: int,
    costs: Costs | StageCosts | None = None,
    memory_limit: MemoryLimit = None,
    objective: str = "span",
    *,
    time_budget: float | None = None,
    ranks: int | None = None,
    deterministic: bool = False,
    check: bool = True,
) -> Schedule:
    """Build, validate and return the schedule ``name`` (one of ``SCHEDULE_NAMES``).

    ``stages`` counts chunks for multi-chunk schedules ("interleaved-1f1b": ``ranks`` ranks,
    default two chunks each; "zbv": two chunks per rank in a V) and costs are then per chunk.
    ``memory_limit`` (units of ``mem_f``; scalar or one per rank) binds zb-auto and zbv and is
    checked for every schedule. zb-auto spends up to ``time_budget`` seconds (default 3) improving
    its heuristic with the exact solver; ``time_budget=0`` returns the heuristic.
    ``objective``: "span" (steps back to back; the paper's) or "makespan" (a barrier per step).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use 'span' or 'makespan'")
    _check_sizes(name, stages, microbatches)
    sc = resolve_costs(costs, stages)
    started = time.perf_counter()
    if name == "gpipe":
        sched = gpipe(stages, microbatches)
    elif name == "1f1b":
        sched = one_f_one_b(stages, microbatches)
    elif name == "zb-h1":
        sched = zb_h1(stages, microbatches)
    elif name == "zb-h2":
        sched = zb_h2(stages, microbatches)
    elif name == "interleaved-1f1b":
        sched = interleaved_one_f_one_b(stages, microbatches, ranks)
    elif name == "zbv":
        limits = rank_limits(memory_limit, stages // 2)
        sched = zbv(stages, microbatches, sc, limits, objective)
    else:
        sched = _zb_auto(stages, microbatches, sc, rank_limits(memory_limit, stages), objective, time_budget, deterministic, started)
    sched = sched.with_info(solve_time_s=time.perf_counter() - started)
    if check:
        validate(sched, sc, memory_limit if name != "zbv" else sched.info.get("memory_limit", memory_limit))
    return sched
