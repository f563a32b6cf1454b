"""zb-auto over V placement: when a memory limit is below 1F1B's, the same model cut into two
chunks per rank in a V (``handcrafted.v_placement``, per-chunk costs ``ResolvedCosts.chunked``)
needs less memory for the same bubble (Qi et al., "Pipeline Parallelism with Controllable
Memory"). ``best_v_schedule`` builds the V schedules, keeps those within the limit and returns the
best under the objective with the V placement's lower bound."""

from __future__ import annotations

from typing import Callable, Sequence

from .building_block import v_half, v_min, v_zb
from .costs import ResolvedCosts
from .handcrafted import v_placement
from .heuristic import analytic_lower_bound, best_of, fits, one_f_one_b_peaks, zbv
from .ir import Schedule

# the fixed V orders, least memory first; zbv is solved under the limit itself
V_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {"v-min": v_min, "v-half": v_half, "v-zb": v_zb}


def below_one_f_one_b(stages: int, costs: ResolvedCosts, limits: Sequence[float] | None) -> bool:
    """Whether some rank's limit is below its 1F1B peak (one stage per rank)."""
    if limits is None:
        return False
    return any(limit < peak for limit, peak in zip(limits, one_f_one_b_peaks(tuple(range(stages)), costs)))


def best_v_schedule(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float], objective: str
) -> tuple[Schedule, float, float] | None:
    """The best V schedule on ``stages`` ranks within ``limits`` (per rank) under ``objective``, its
    value and the V placement's lower bound; None when none fits. Its stages are the 2 x ``stages``
    chunks, with ``chunked(2)`` costs."""
    chunks = 2 * stages
    chunk_costs = costs.chunked(2)
    candidates = [build(chunks, microbatches) for build in V_BUILDERS.values()]
    candidates = [c for c in candidates if fits(c, chunk_costs, limits)]
    try:
        candidates.append(zbv(chunks, microbatches, chunk_costs, limits, objective))
    except ValueError:  # the limit is below one microbatch of a rank
        pass
    candidates = [c for c in candidates if fits(c, chunk_costs, limits)]
    if not candidates:
        return None
    best, value = best_of(candidates, chunk_costs, objective)
    bound = analytic_lower_bound(chunks, microbatches, v_placement(chunks), chunk_costs, objective)
    return best, value, bound
