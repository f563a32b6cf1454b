"""Candidate cuts for the cut decision (`cut_choice.py`): where stages could begin, found on the
model's segments (`cut_units.Segments`).

A candidate is the cut of the smallest bottleneck: every stage's time on its own rank (a V's
chunks: each at most half of it) within one cap, the least cap for which the segments pack into
the stages, packed from the front or from the back; every stage holds at least one parameter (a
rank with nothing to train is no use, and torch's optimizers refuse an empty parameter list);
where a memory limit is given, each stage must also hold its parameters' state and `mult`
microbatches of its activations within its rank's limit, for every `mult` from one microbatch to
1F1B's count, so that the cut that buys time with memory and the one that buys memory with time
are both among the candidates. Their neighbours (one boundary moved by one segment) refine the
best one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .cut_units import V_CHUNKS_PER_RANK, Segments, v_rank

PLACEMENT_NAMES = ("in-line", "v")
BISECTION_STEPS = 40


@dataclass(frozen=True)
class Cut:
    """Where the stages of one pipeline begin: `positions` (stages 1.. in order) among the
    model's positions, and `placement`: "in-line" (stage s on rank s) or "v" (two chunks per
    rank in a V: chunk c on rank c, then back up)."""

    placement: str
    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENT_NAMES:
            raise ValueError(f"Cut placement must be one of {PLACEMENT_NAMES}, got {self.placement!r}")

    @property
    def stages(self) -> int:
        return len(self.positions) + 1

    def ranks(self) -> int:
        return self.stages // V_CHUNKS_PER_RANK if self.placement == "v" else self.stages

    def rank_of(self, stage: int) -> int:
        return v_rank(stage, self.ranks()) if self.placement == "v" else stage

    def bounds(self, end: int) -> list[int]:
        return [0, *self.positions, end]

    def __str__(self) -> str:
        return f"{self.placement} at {list(self.positions)}"


# (stage, its rank, first segment, end segment, parameter ids) -> whether the stage fits its memory
MemoryRule = Callable[[int, int, int, int, frozenset[int]], bool]


def _fits_anywhere(*_: object) -> bool:
    return True


def pack(
    segments: Segments, cut_stages: int, rank_of: Callable[[int], int], cap: Sequence[float], memory: MemoryRule,
    backward: bool = False,
) -> list[int] | None:
    """Segment bounds of `cut_stages` stages, each the longest run of segments (from the front,
    or with `backward` from the back) whose time on its rank stays within `cap[stage]` and whose
    memory passes `memory`, and which holds a parameter where the model has any (leaving one
    segment that reads a parameter to each stage still to place); None where the segments do not
    fit."""
    count = segments.count
    holders = [j for j in range(count) if segments.param_ids[j]]  # segments that read a parameter
    if holders and len(holders) < cut_stages:
        return None
    step = -1 if backward else 1
    edge = count if backward else 0
    edges = [edge]
    for placed, stage in enumerate(range(cut_stages - 1, -1, -1) if backward else range(cut_stages)):
        rank, left = rank_of(stage), cut_stages - placed - 1  # stages still to place, a segment each
        limit = left if backward else count - left
        if holders and left:  # the segments after this stage keep a parameter for each stage left
            limit = max(limit, holders[left - 1] + 1) if backward else min(limit, holders[-left])
        ids: frozenset[int] = frozenset()
        grown_to = edge
        while grown_to != limit:
            segment = grown_to - 1 if backward else grown_to
            lo, hi = sorted((edge, grown_to + step))
            more = ids | segments.param_ids[segment]
            if segments.time(rank, segments.bounds[lo], segments.bounds[hi]) > cap[stage] or not memory(
                stage, rank, lo, hi, more
            ):
                break
            ids, grown_to = more, grown_to + step
        if grown_to == edge or (left == 0 and grown_to != limit) or (holders and not ids):
            return None
        edge = grown_to
        edges.append(edge)
    return [segments.bounds[e] for e in sorted(edges)[1:-1]]


def bottleneck_cut(
    segments: Segments, ranks: int, placement: str, memory: MemoryRule = _fits_anywhere, backward: bool = False
) -> tuple[int, ...] | None:
    """The cut positions of the least cap that packs (`pack`): in-line, every stage's time on its
    rank within the cap; a V, every chunk's within half of it."""
    chunks, share, rank_of = chunking(ranks, placement)
    end = segments.units.positions
    high = max(segments.time(r, 0, end) for r in range(ranks)) * 1.0001 + 1e-12
    found = least_cap(lambda cap: pack(segments, chunks, rank_of, [cap * share] * chunks, memory, backward), high)
    return None if found is None else tuple(found[1])


def chunking(ranks: int, placement: str) -> tuple[int, float, Callable[[int], int]]:
    """`placement`'s chunks over `ranks`, the share of a rank's cap each takes, and each chunk's rank."""
    if placement == "v":
        return V_CHUNKS_PER_RANK * ranks, 1.0 / V_CHUNKS_PER_RANK, lambda c: v_rank(c, ranks)
    return ranks, 1.0, lambda s: s


def least_cap(packed: Callable[[float], list[int] | None], high: float) -> tuple[float, list[int]] | None:
    """The least cap at which `packed(cap)` packs (bisection below `high`, `BISECTION_STEPS`
    halvings) and its packing; None where it does not pack at `high`."""
    best = packed(high)
    if best is None:
        return None
    low = 0.0
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        if (found := packed(mid)) is None:
            low = mid
        else:
            high, best = mid, found
    return high, best


def holds_parameters(cut: Cut, segments: Segments) -> bool:
    """Whether every stage of `cut` reads a parameter (or the model has none)."""
    if not any(segments.param_ids):
        return True
    bounds = cut.bounds(segments.units.positions)
    return all(segments.params_of(a, b) for a, b in zip(bounds, bounds[1:]))


def neighbours(cut: Cut, segments: Segments) -> list[Cut]:
    """`cut` with one boundary moved by one segment either way (positions stay increasing, every
    stage still holding a parameter: `holds_parameters`)."""
    bounds = segments.bounds
    index = {b: j for j, b in enumerate(bounds)}
    result = []
    for k, position in enumerate(cut.positions):
        j = index.get(position)
        if j is None:
            continue
        for step in (-1, 1):
            moved = bounds[j + step] if 0 < j + step < len(bounds) - 1 else None
            if moved is None:
                continue
            positions = (*cut.positions[:k], moved, *cut.positions[k + 1 :])
            moved_cut = Cut(cut.placement, positions)
            if all(a < b for a, b in zip(positions, positions[1:])) and holds_parameters(moved_cut, segments):
                result.append(moved_cut)
    return result
