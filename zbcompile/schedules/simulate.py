"""Score a schedule: makespan, span, both bubble rates, per-rank peak memory and idle time.

Definitions (see docs/schedules.md): every action starts as early as its rank and its inputs allow
(``timing.asap_timing``); a cross-rank dependency is delayed by ``comm``.

- reductions (data-parallel replicas, ``costs.reduce``): stage s's gradient reduction starts when
  its last W (or fused B) has ended and its rank's link has finished the reductions before it
  (posted in the order of their last W), and takes ``reduce[s]``; it occupies the link, not the
  compute, so a rank's end is the later of its last action's and its last reduction's;
- makespan: first start to last end over all ranks (a step that ends in a barrier);
- span: the longest per-rank span, a rank's own first start to its own end (steps back to
  back, what the paper reports);
- bubble_rate = 1 - busy / (ranks * makespan); stage_bubble_rate = 1 - busy / (ranks * span);
- peak_memory[r]: the largest activation memory rank r holds, in units of ``mem_b``: the running
  sum of the memory deltas in rank r's order (its actions never overlap, so that is time order).
  With ``mem_w > mem_b`` an I raises the level, so the peak can follow an I; a fused B counts its
  I part (``ResolvedCosts.memory_rise``).

For single-chunk schedules a rank is a stage; multi-chunk schedules report per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .costs import Costs, ResolvedCosts, resolve_costs
from .ir import Action, Schedule
from .timing import asap_timing

GRAD_KINDS = ("W", "B")  # the actions that make a stage's parameter gradients


@dataclass(frozen=True)
class SimResult:
    """Timing and memory of one schedule under given costs (all per-rank tuples indexed by rank)."""

    start: Mapping[Action, float]
    end: Mapping[Action, float]
    makespan: float
    span: float
    bubble_rate: float
    stage_bubble_rate: float
    busy: tuple[float, ...]
    rank_span: tuple[float, ...]
    idle_time: tuple[float, ...]  # gaps inside each rank's own span (the reductions' tail included)
    peak_memory: tuple[float, ...]
    reduction_end: Mapping[int, float] | None = None  # stage -> its gradient reduction's end; None: no reduction

    def objective(self, name: str) -> float:
        """The value an objective ("span" or "makespan") minimises."""
        if name == "span":
            return self.span
        if name == "makespan":
            return self.makespan
        raise ValueError(f"unknown objective {name!r}; use 'span' or 'makespan'")


def peak_memory(schedule: Schedule, costs: ResolvedCosts) -> tuple[float, ...]:
    """Per-rank peak of the running sum of memory deltas, in program order (a fused B peaks at
    the end of its I part, ``ResolvedCosts.memory_rise``)."""
    peaks = []
    for row in schedule.actions:
        level = peak = 0.0
        for a in row:
            peak = max(peak, level + costs.memory_rise(a.stage, a.kind))
            level += costs.memory_delta(a.stage, a.kind)
        peaks.append(peak)
    return tuple(peaks)


def reduction_ends(
    rows: Sequence[Sequence[Action]], end: Mapping[Action, float], costs: ResolvedCosts
) -> list[dict[int, float]]:
    """Per rank, stage -> the end of that rank's reduction of the stage's gradients, the rank's
    link taking its stages in the order their last gradient action (W or B) ends."""
    per_rank = []
    for row in rows:
        last: dict[int, float] = {}
        for a in row:
            if a.kind in GRAD_KINDS:
                last[a.stage] = max(last.get(a.stage, 0.0), end[a])
        link, ends = 0.0, {}
        for stage in sorted(last, key=lambda s: (last[s], s)):
            link = ends[stage] = max(link, last[stage]) + costs.reduction(stage)
        per_rank.append(ends)
    return per_rank


def simulate(schedule: Schedule, costs: Costs | ResolvedCosts | None = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (default: uniform unit costs) and measure it."""
    sc = resolve_costs(costs, schedule.stages)
    rows = [tuple(a for a in row if a.is_compute) for row in schedule.actions]
    timing = asap_timing(rows, schedule.stages, schedule.stage_to_rank, lambda a: sc.duration(a.stage, a.kind), sc.comm)
    busy = tuple(sum(sc.duration(a.stage, a.kind) for a in row) for row in rows)
    rank_end = [max(timing.end[a] for a in row) if row else 0.0 for row in rows]
    reduced = None
    if sc.reduces:
        per_rank = reduction_ends(rows, timing.end, sc)
        rank_end = [max([e, *ends.values()]) for e, ends in zip(rank_end, per_rank)]
        reduced = {}
        for ends in per_rank:
            for stage, t in ends.items():
                reduced[stage] = max(reduced.get(stage, t), t)
    rank_span = tuple((rank_end[r] - min(timing.start[a] for a in row)) if row else 0.0 for r, row in enumerate(rows))
    starts = list(timing.start.values())
    ends = [*timing.end.values(), *(reduced.values() if reduced is not None else ())]
    makespan = (max(ends) - min(starts)) if starts else 0.0
    span = max(rank_span, default=0.0)
    total_busy = sum(busy)
    ranks = len(rows)

    def rate(window: float) -> float:
        return 1.0 - total_busy / (ranks * window) if window > 0 else 0.0

    return SimResult(
        start=timing.start, end=timing.end, makespan=makespan, span=span, bubble_rate=rate(makespan),
        stage_bubble_rate=rate(span), busy=busy, rank_span=rank_span,
        idle_time=tuple(s - b for s, b in zip(rank_span, busy)), peak_memory=peak_memory(schedule, sc),
        reduction_end=reduced,
    )
