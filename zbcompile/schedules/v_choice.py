"""zb-auto over V placement: the same model cut into two chunks per rank in a V
(``handcrafted.v_placement``, per-chunk costs ``ResolvedCosts.chunked``) needs less memory for
the same bubble (Qi et al., "Pipeline Parallelism with Controllable Memory"), and half-size
chunks shorten the fill and drain where there are few microbatches per rank, at the price of
twice the messages (the chunks' costs carry ``comm`` for each). ``best_v_schedule`` builds the V
schedules (the building blocks, ZB-V solved under the limit, DualPipeV), keeps those within the
limit and returns the best under the objective with the V placement's lower bound;
``choose_placement`` compares it with zb-auto's one-stage-per-rank result by the same objective,
under a limit below 1F1B's or, with ``v_always``, whatever the limit."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from .building_block import v_half, v_min, v_zb
from .costs import ResolvedCosts
from .dualpipe import dualpipev
from .handcrafted import v_placement
from .heuristic import analytic_lower_bound, best_of, fits, one_f_one_b_peaks, zbv
from .ir import Schedule

PLACEMENTS = ("in-line", "v")  # one stage per rank; two chunks per rank in a V
# the fixed V orders, least memory first; zbv is solved under the limit itself
V_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "v-min": v_min, "v-half": v_half, "v-zb": v_zb, "dualpipev": dualpipev
}


def below_one_f_one_b(stages: int, costs: ResolvedCosts, limits: Sequence[float] | None) -> bool:
    """Whether some rank's limit is below its 1F1B peak (one stage per rank)."""
    if limits is None:
        return False
    return any(limit < peak for limit, peak in zip(limits, one_f_one_b_peaks(tuple(range(stages)), costs)))


def best_v_schedule(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str,
    chunk_costs: ResolvedCosts | None = None,
) -> tuple[Schedule, float, float] | None:
    """The best V schedule on ``stages`` ranks within ``limits`` (per rank) under ``objective``, its
    value and the V placement's lower bound; None when none fits. Its stages are the 2 x ``stages``
    chunks, with ``chunk_costs`` (default: ``costs.chunked(2)``)."""
    chunks = 2 * stages
    chunk_costs = chunk_costs or costs.chunked(2)
    candidates = [build(chunks, microbatches) for build in V_BUILDERS.values()]
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


def choose_placement(
    solve_in_line: Callable[[], Schedule], stages: int, microbatches: int, costs: ResolvedCosts,
    limits: Sequence[float] | None, objective: str, placements: Sequence[str], chunk_costs: ResolvedCosts | None = None,
    v_always: bool = False,
) -> Schedule:
    """zb-auto's result over ``placements`` (see ``PLACEMENTS``): ``solve_in_line()`` (zb-auto with
    one stage per rank) and, with "v" allowed and a limit below 1F1B's (with ``v_always``: under
    any limit, or none), the best V schedule; the better one under ``objective`` (the V only when
    strictly better), ``info["placement"]`` saying which. A V result has 2 x ``stages`` chunks
    (costs ``chunk_costs``, by default ``costs.chunked(2)``); ``lower_bound`` is then the smaller
    of both placements' bounds. With "v" alone, the V is built under any limit."""
    unknown = set(placements) - set(PLACEMENTS)
    if unknown or not placements:
        raise ValueError(f"zb-auto: placements must be among {PLACEMENTS}, got {tuple(placements)}")
    in_line_allowed = "in-line" in placements
    v_allowed = "v" in placements and (not in_line_allowed or v_always or below_one_f_one_b(stages, costs, limits))
    v = best_v_schedule(stages, microbatches, costs, limits, objective, chunk_costs) if v_allowed else None
    in_line = None
    try:
        if in_line_allowed:
            in_line = solve_in_line()
    except ValueError:  # no one-stage-per-rank schedule fits the limit
        if v is None:
            raise
    if v is None:
        if in_line is None:
            raise ValueError(
                f"zb-auto: no V schedule fits memory_limit {list(limits or [])} and {placements} excludes one stage "
                "per rank"
            )
        return in_line.with_info(placement="in-line")
    v_sched, v_value, v_bound = v
    bound = v_bound if in_line is None else min(in_line.info["lower_bound"], v_bound)
    if in_line is not None and in_line.info["value"] <= v_value:
        at_bound = in_line.info["value"] <= bound * (1 + 1e-9)
        return in_line.with_info(placement="in-line", lower_bound=bound, v_value=v_value, at_lower_bound=at_bound)
    return replace(v_sched, name="zb-auto").with_info(
        placement="v", v_source=v_sched.name, objective=objective, value=v_value, lower_bound=bound,
        in_line_value=None if in_line is None else in_line.info["value"], status="v-placement",
        at_lower_bound=v_value <= bound * (1 + 1e-9),
    )
