"""The zb-auto heuristic and the ZB-V generator.

zb-auto's heuristic tries the ``GreedyPolicy`` grid of the list scheduler (the paper's reference
code grid-searches three flags the same way; large problems run fewer or none), the analytic member
of the search family (``search.pattern_rows``) and the handcrafted 1F1B (with B split into I then
W), ZB-H1 and ZB-H2 where they fit in memory, and the paper's own construction (``reference.py``,
kept only where strictly better), all timed by ``fastsim.Evaluator``, and keeps the best under the
objective. So it is never worse than those. ZB-V is handcrafted (``handcrafted.zb_v``) with
the list scheduler on the V placement as a fallback.
When M_W > M_B (an I raises memory) handcrafted orders that exceed the limit are also tried with
their W moved earlier where needed (``row_edits.make_room``).
"""

from __future__ import annotations

import math
from typing import Sequence

from .costs import ResolvedCosts, fits_memory
from .fastsim import Evaluator
from .greedy import POLICIES, QUICK_POLICIES, GreedyPolicy, MemoryTooSmall, list_schedule
from .handcrafted import v_placement, zb_v
from .ir import Action, Schedule
from .reference import ALL_FLAGS, QUICK_FLAGS, reference_rows
from .row_edits import make_room
from .search import analytic_parameters, handcrafted_rows, pattern_rows
from .simulate import peak_memory, simulate

_STRICTLY_BETTER = 1e-9  # relative margin by which the paper's construction must beat the others


def b_to_iw(schedule: Schedule) -> Schedule:
    """Replace every fused B by I immediately followed by W (same memory, earlier gradient send)."""
    rows = []
    for row in schedule.actions:
        out = []
        for a in row:
            out += [Action(a.stage, "I", a.microbatch), Action(a.stage, "W", a.microbatch)] if a.kind == "B" else [a]
        rows.append(tuple(out))
    return Schedule(schedule.name, schedule.stages, schedule.microbatches, schedule.stage_to_rank, tuple(rows))


def fits(schedule: Schedule, costs: ResolvedCosts, limits: Sequence[float] | None) -> bool:
    if limits is None:
        return True
    return all(fits_memory(p, l) for p, l in zip(peak_memory(schedule, costs), limits))


def minimum_memory(stage_to_rank: Sequence[int], costs: ResolvedCosts) -> tuple[float, ...]:
    """The smallest per-rank limit under which a schedule exists: the peak of one microbatch
    passing alone through the rank's stages (its F in stage order, then I and at once W in reverse).
    One stage per rank: max(mem_b, mem_w) (an I adds mem_w - mem_b when that is positive)."""
    ranks = 1 + max(stage_to_rank)
    needed = []
    for rank in range(ranks):
        own = [s for s, r in enumerate(stage_to_rank) if r == rank]
        level = peak = 0.0
        for s in own:
            level += costs.mem_b[s]
            peak = max(peak, level)
        for s in reversed(own):
            level += costs.mem_w[s] - costs.mem_b[s]
            peak = max(peak, level)
            level -= costs.mem_w[s]
        needed.append(peak)
    return tuple(needed)


def one_f_one_b_peak(mem_b: float, mem_w: float, stages: int) -> float:
    """1F1B's peak on its first stage for ``stages`` stages and enough microbatches: p in flight,
    and the last one's backward adds max(0, mem_w - mem_b) (a fused B runs its I part first), i.e.
    (p - 1) mem_b + max(mem_b, mem_w)."""
    return stages * mem_b + max(0.0, mem_w - mem_b)


def one_f_one_b_peaks(stage_to_rank: Sequence[int], costs: ResolvedCosts) -> tuple[float, ...]:
    """1F1B's memory per rank: ``one_f_one_b_peak`` of the rank's summed ``mem_b`` and ``mem_w``
    (a whole rank's activations per microbatch), with as many in flight as there are ranks."""
    ranks = 1 + max(stage_to_rank)
    own = [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(ranks)]
    return tuple(
        one_f_one_b_peak(sum(costs.mem_b[s] for s in stages), sum(costs.mem_w[s] for s in stages), ranks)
        for stages in own
    )


def check_memory_feasible(name: str, stage_to_rank: Sequence[int], costs: ResolvedCosts, limits) -> None:
    if limits is None:
        return
    needed = minimum_memory(stage_to_rank, costs)
    short = [r for r, (l, n) in enumerate(zip(limits, needed)) if not fits_memory(n, l)]
    if short:
        raise ValueError(
            f"{name}: memory_limit {[limits[r] for r in short]} on ranks {short} is below one microbatch's "
            f"peak {[needed[r] for r in short]} (its activations, or mem_w where an I raises memory to it); "
            "no schedule fits: raise it to at least that"
        )


QUICK_SIZE = 1024  # stages x microbatches above which the list scheduler runs once (or not: uniform costs)


def best_of(candidates: Sequence[Schedule], costs: ResolvedCosts, objective: str) -> tuple[Schedule, float]:
    """The candidate with the smallest simulated objective. List-scheduled candidates are ranked by
    their own timing (an upper bound on the simulated value) and only the best one is simulated."""
    estimated = [c for c in candidates if f"estimate_{objective}" in c.info]
    exact = [c for c in candidates if f"estimate_{objective}" not in c.info]
    if estimated:
        exact.append(min(estimated, key=lambda c: c.info[f"estimate_{objective}"]))
    scored = [(simulate(c, costs).objective(objective), i) for i, c in enumerate(exact)]
    value, index = min(scored)
    return exact[index], value


def zb_auto_heuristic(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str = "span",
    policies: Sequence[GreedyPolicy] | None = None,
) -> Schedule:
    """Best of the list-scheduler policies, the analytic member of the search family
    (``search.pattern_rows``) and the handcrafted schedules that fit in memory."""
    ev = Evaluator(stages, microbatches, tuple(range(stages)), costs)
    rows, _, source = zb_auto_candidates(stages, microbatches, costs, limits, objective, policies, ev)
    return ev.schedule("zb-auto", rows, {"heuristic_source": source})


def zb_auto_candidates(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float] | None, objective: str,
    policies: Sequence[GreedyPolicy] | None, ev: Evaluator,
) -> tuple[list[list[int]], tuple[float, float], str]:
    """The heuristic's winner as evaluator rows, its score (objective, sum of rank spans) and its
    source. Large problems with the same costs on every stage skip the list scheduler: the
    analytic pattern covers them and the list scheduler would take most of the time."""
    placement = tuple(range(stages))
    check_memory_feasible("zb-auto", placement, costs, limits)
    large = stages * microbatches > QUICK_SIZE
    if policies is None:
        policies = () if large and _uniform(costs) else QUICK_POLICIES[:1] if large else POLICIES
    lims = list(limits) if limits is not None else [math.inf] * stages
    scored: list[tuple[tuple[float, float], int, str, list[list[int]]]] = []

    def consider(source: str, rows: list[list[int]] | None) -> None:
        if rows is not None and (limits is None or ev.fits(rows, lims)):
            scored.append((ev.score(rows, objective), len(scored), source, rows))

    for policy in policies:
        try:
            rows = ev.rows_of(list_schedule("zb-auto", stages, microbatches, placement, costs, limits, policy))
        except MemoryTooSmall:
            continue
        consider("list", rows)
    warm, defer = analytic_parameters(stages, costs)
    consider("pattern", pattern_rows(ev, lims, warm, defer))
    raises = any(mw > mf for mf, mw in zip(costs.mem_b, costs.mem_w))
    for name in ("1f1b", "zb-h1", "zb-h2"):
        rows = handcrafted_rows(ev, name)
        consider(name, rows)
        if raises and limits is not None:  # I raises memory: the same order with W moved to fit
            consider(f"{name} (W moved to fit)", make_room(ev, rows, lims))
    # the paper's construction; kept only where it is strictly better under the objective, so
    # that ties keep the orders above (which start the stages earlier: a smaller makespan)
    reference = reference_rows(ev, limits, objective, QUICK_FLAGS if large else ALL_FLAGS)
    if reference is not None:
        before = min((t[0][0] for t in scored), default=math.inf)
        consider(*reference)
        margin = _STRICTLY_BETTER * max(1.0, abs(before))
        if before < math.inf and scored[-1][2] == reference[0] and not scored[-1][0][0] < before - margin:
            scored.pop()
    if not scored:
        raise ValueError(f"zb-auto: no schedule fits memory_limit {list(limits)}; raise it")
    value, _, source, rows = min(scored, key=lambda t: (t[0], t[1]))
    return rows, value, source


def sequential(stages: int, microbatches: int, stage_to_rank: Sequence[int]) -> Schedule:
    """One microbatch at a time: per rank its F in stage order, then I and W in reverse. Every
    rank peaks at ``minimum_memory``; the fallback when nothing better fits a tight limit. Each
    rank's order follows one global order (microbatch, then position on the F...F I...I chain),
    so it cannot deadlock."""
    ranks = 1 + max(stage_to_rank)
    rows = []
    for rank in range(ranks):
        own = [s for s, r in enumerate(stage_to_rank) if r == rank]
        row = []
        for k in range(microbatches):
            row += [Action(s, "F", k) for s in own]
            for s in reversed(own):
                row += [Action(s, "I", k), Action(s, "W", k)]
        rows.append(tuple(row))
    return Schedule("zbv", stages, microbatches, tuple(stage_to_rank), tuple(rows))


def _uniform(costs: ResolvedCosts) -> bool:
    return all(len(set(v)) <= 1 for v in (costs.f, costs.i, costs.w, costs.mem_b, costs.mem_w))


def zbv(
    stages: int, microbatches: int, costs: ResolvedCosts, limits: Sequence[float] | None = None, objective: str = "span"
) -> Schedule:
    """ZB-V: the handcrafted schedule (``handcrafted.zb_v``) at 1F1B's memory unless a limit is
    given; the list scheduler on the same V placement is tried as well when the costs differ between
    chunks or the handcrafted order does not fit the limit, and the better one is kept."""
    if stages < 2 or stages % 2:
        raise ValueError(f"zbv puts two chunks on each rank: stages (chunks) must be even and >= 2, got {stages}")
    placement = v_placement(stages)
    if limits is None:
        # 1F1B's memory, at least one microbatch's peak (chunks whose M_W exceed the other
        # chunk's M_B need more)
        limits = tuple(
            max(need, peak) for need, peak in zip(minimum_memory(placement, costs), one_f_one_b_peaks(placement, costs))
        )
    check_memory_feasible("zbv", placement, costs, limits)
    candidates = []
    hand = zb_v(stages, microbatches)
    if fits(hand, costs, limits):
        candidates.append(hand.with_info(zbv_source="handcrafted"))
    elif any(mw > mf for mf, mw in zip(costs.mem_b, costs.mem_w)):
        # I raises memory, so the deferred W of the cool-down can exceed 1F1B's memory: run them
        # earlier where needed
        ev = Evaluator(stages, microbatches, placement, costs)
        rows = make_room(ev, ev.rows_of(hand), limits)
        if rows is not None:
            candidates.append(ev.schedule("zbv", rows).with_info(zbv_source="handcrafted (W moved to fit)"))
    if not candidates or not _uniform(costs) or candidates[0].info["zbv_source"] != "handcrafted":
        for policy in POLICIES:
            try:
                listed = list_schedule("zbv", stages, microbatches, placement, costs, limits, policy)
            except MemoryTooSmall:
                continue
            candidates.append(listed.with_info(zbv_source="list"))
    if not candidates:  # one microbatch at a time: peaks at exactly minimum_memory
        candidates.append(sequential(stages, microbatches, placement).with_info(zbv_source="sequential"))
    best, _ = best_of(candidates, costs, objective)
    return best.with_info(memory_limit=list(limits))


def analytic_lower_bound(
    schedule_stages: int, microbatches: int, stage_to_rank: Sequence[int], costs: ResolvedCosts, objective: str
) -> float:
    """Memory-free bound. span: the busiest rank's work. makespan: a rank cannot start before the
    first forward reaches its earliest stage, and then has all its own work to do."""
    ranks = 1 + max(stage_to_rank)
    busy = [0.0] * ranks
    for s, r in enumerate(stage_to_rank):
        busy[r] += microbatches * costs.work(s)
    if objective == "span":
        return max(busy)
    arrival, first = 0.0, [math.inf] * ranks
    for s, r in enumerate(stage_to_rank):
        first[r] = min(first[r], arrival)
        if s + 1 < schedule_stages:
            arrival += costs.f[s] + (costs.comm if stage_to_rank[s + 1] != r else 0.0)
    return max(f + b for f, b in zip(first, busy))
