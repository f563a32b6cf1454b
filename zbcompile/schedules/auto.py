"""zb-auto: the heuristic (``heuristic.py``), then the search (``search.py``), then CP-SAT
(``solver.py``) on small problems, all within one time budget.

The budget counts from the ``make_schedule`` call and covers everything: heuristic, evaluator,
search, model building and solving. ``deterministic=True`` replaces wall-clock stops by fixed
amounts of work derived from the budget (search evaluations, CP-SAT deterministic time). A phase
is skipped once the schedule reaches the lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from .costs import ResolvedCosts
from .fastsim import Evaluator
from .handcrafted import in_line
from .heuristic import analytic_lower_bound, zb_auto_candidates
from .ir import Schedule
from .search import search

DEFAULT_TIME_BUDGET_S = 3.0
CPSAT_MAX_ACTIONS = 1200  # above this, building the CP-SAT model costs more than it returns


@dataclass(frozen=True)
class _Budget:
    seconds: float
    deterministic: bool
    started: float

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


def _at_bound(info: dict) -> bool:
    return info["value"] <= info["lower_bound"] * (1 + 1e-9)


def zb_auto(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str,
    time_budget: float | None, deterministic: bool, started: float,
) -> Schedule:
    """The best zb-auto schedule found within ``time_budget`` seconds (default 3) counted from
    ``started``; ``info`` records each phase's value, the lower bound and the status."""
    budget = _Budget(DEFAULT_TIME_BUDGET_S if time_budget is None else float(time_budget), deterministic, started)
    placement = in_line(stages)
    ev = Evaluator(stages, microbatches, placement, costs)
    rows, score, source = zb_auto_candidates(stages, microbatches, costs, limits, objective, None, ev)
    info = {
        "objective": objective,
        "heuristic_value": score[0],
        "heuristic_time_s": time.perf_counter() - started,
        "value": score[0],
        "lower_bound": analytic_lower_bound(stages, microbatches, placement, costs, objective),
        "status": "heuristic",
    }
    use_cpsat = 3 * stages * microbatches <= CPSAT_MAX_ACTIONS
    if budget.seconds > 0 and not _at_bound(info) and (deterministic or budget.left() > 0):
        # Keep a margin for turning the result into a Schedule (about one evaluation's time).
        rows = _search_phase(ev, limits, objective, rows, score, budget, 0.7 if use_cpsat else 0.9, info)
    sched = ev.schedule("zb-auto", rows, {"heuristic_source": source})
    if budget.seconds > 0 and use_cpsat and not _at_bound(info) and (deterministic or budget.left() > 0.3):
        sched = _solver_phase(sched, costs, limits, objective, budget, info)
    info["at_lower_bound"] = _at_bound(info)
    return sched.with_info(**info)


def _search_phase(
    ev: Evaluator, limits: Sequence[float] | None, objective: str, rows: list[list[int]], score: tuple[float, float],
    budget: _Budget, share: float, info: dict,
) -> list[list[int]]:
    """The search from ``rows`` on ``share`` of the budget (of what is left, unless deterministic);
    returns the better rows and records the search's steps, ``value`` and ``status`` in ``info``."""
    search_budget = budget.left() * share if not budget.deterministic else budget.seconds * share
    result = search(ev, limits, objective, search_budget, budget.deterministic, start_rows=rows)
    info.update(result.info)
    if result.rows is not None and result.score < score:
        rows = result.rows
        info["value"] = result.score[0]
        info["status"] = "search"
    return rows


def _solver_phase(
    sched: Schedule, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str, budget: _Budget, info: dict,
) -> Schedule:
    """CP-SAT warm-started from ``sched``; returns the better schedule and records the solver's
    status, ``value`` and the proven ``lower_bound`` in ``info``."""
    from .solver import improve

    # CP-SAT's presolve does not always stop on time: keep a margin for it and for re-timing.
    solver_budget = budget.seconds * 0.25 if budget.deterministic else 0.8 * budget.left() - 0.1
    result = improve(sched, costs, limits, objective, solver_budget, deterministic=budget.deterministic)
    solver_info = dict(result.info)
    info["solver_status"] = solver_info.pop("status")
    info.update(solver_info)
    if info["solver_status"] in ("OPTIMAL", "FEASIBLE"):
        info["status"] = info["solver_status"]
    if result.value < info["value"]:
        sched = result.schedule
        info["value"] = result.value
    info["lower_bound"] = max(info["lower_bound"], result.lower_bound)
    return sched
