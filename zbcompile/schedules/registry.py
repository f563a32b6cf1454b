"""``make_schedule``: one entry point for every schedule, validated before it is returned."""

from __future__ import annotations

import time
from typing import Sequence, Union

from .costs import Costs, StageCosts, resolve_costs
from .handcrafted import gpipe, interleaved_one_f_one_b, one_f_one_b, zb_h1, zb_h2
from .heuristic import analytic_lower_bound, zb_auto_heuristic, zbv
from .ir import Schedule
from .simulate import simulate
from .validate import rank_limits, validate

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv")
OBJECTIVES = ("span", "makespan")
DEFAULT_TIME_BUDGET_S = 3.0

MemoryLimit = Union[None, float, Sequence[float]]


def _check_sizes(name: str, stages: int, microbatches: int) -> None:
    for label, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive int, got {value!r}")
    if name == "zbv" and stages < 2:
        raise ValueError(f"zbv needs at least 2 stages (two chunks per rank), got {stages}")


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
        limits = rank_limits(memory_limit, stages)
        sched = zb_auto_heuristic(stages, microbatches, sc, limits, objective)
        budget = DEFAULT_TIME_BUDGET_S if time_budget is None else float(time_budget)
        heuristic_time = time.perf_counter() - started
        value = simulate(sched, sc).objective(objective)
        bound = analytic_lower_bound(stages, microbatches, sched.stage_to_rank, sc, objective)
        info = {
            "objective": objective,
            "heuristic_value": value,
            "heuristic_time_s": heuristic_time,
            "value": value,
            "lower_bound": bound,
            "status": "heuristic",
        }
        if budget > 0:
            from .solver import improve

            result = improve(sched, sc, limits, objective, budget - heuristic_time, deterministic=deterministic)
            info.update(result.info)
            if result.value < value:
                sched = result.schedule
                info["value"] = result.value
            info["lower_bound"] = max(bound, result.lower_bound)
        sched = sched.with_info(**info)
    sched = sched.with_info(solve_time_s=time.perf_counter() - started)
    if check:
        validate(sched, sc, memory_limit if name != "zbv" else sched.info.get("memory_limit", memory_limit))
    return sched
