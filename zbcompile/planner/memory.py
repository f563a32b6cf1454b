"""How the planner prices memory: the least step a rank's room allows, and the cut with each
stage's recomputation chosen for the room it has.

`memory_bound`: Little's law on the activations a rank holds. `recompute_cut`: where the stages
begin and how much each recomputes, decided together. A uniform recompute level makes every stage
pay for the memory the first stage needs, and a cut balanced without recomputation leaves the
stages that do recompute the slowest. Here each stage (a V's chunk) takes the fastest level at
which it holds its state and `flight` microbatches of its activations within its rank's limit
(`cut_choice.memory_rule`), and the cut is the one of the least bottleneck under that choice:
stages that recompute get fewer layers. Pure Python: no torch.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from zbcompile.schedules.cut_choice import CutSettings, memory_rule
from zbcompile.schedules.cut_search import Cut, chunking, least_cap, pack
from zbcompile.schedules.cut_units import Segments


def recompute_cut(
    levels: Sequence[Segments], ranks: int, placement: str, settings: CutSettings, flight: int,
    backward: bool = False,
) -> tuple[Cut, tuple[int, ...]] | None:
    """The cut and each stage's recompute level (an index into `levels`: the model's segments at
    each level, all on one set of bounds) of the least bottleneck, every stage at the fastest level
    that fits `flight` microbatches in flight (1F1B's count per stage where fewer), packed from the
    front (or with `backward` from the back); None where no cut fits at any level."""
    chunks, share, rank_of = chunking(ranks, placement)
    rules = [memory_rule(s.units, settings, s, ranks, flight, placement == "v") for s in levels]
    base, end = levels[0], levels[0].units.positions
    fastest: dict[tuple[int, int, int], tuple[float, int | None]] = {}  # (stage, lo, hi) -> (seconds, level)

    def fastest_fitting(stage: int, rank: int, lo: int, hi: int, params: frozenset[int]) -> tuple[float, int | None]:
        if (stage, lo, hi) not in fastest:
            timed = [(s.time(rank, s.bounds[lo], s.bounds[hi]), k) for k, s in enumerate(levels)]
            fitting = [(t, k) for t, k in timed if rules[k](stage, rank, lo, hi, params)]
            fastest[(stage, lo, hi)] = min(fitting) if fitting else (math.inf, None)
        return fastest[(stage, lo, hi)]

    def packed(cap: float) -> list[int] | None:
        def fits(stage: int, rank: int, lo: int, hi: int, params: frozenset[int]) -> bool:
            return fastest_fitting(stage, rank, lo, hi, params)[0] <= cap * share
        return pack(base, chunks, rank_of, [math.inf] * chunks, fits, backward)

    found = least_cap(packed, max(s.time(r, 0, end) for s in levels for r in range(ranks)) * 1.0001 + 1e-12)
    if found is None:
        return None
    cut = Cut(placement, tuple(found[1]))
    index = {b: j for j, b in enumerate(base.bounds)}
    edges = [index[b] for b in cut.bounds(end)]
    chosen = tuple(
        fastest_fitting(stage, rank_of(stage), lo, hi, frozenset().union(*base.param_ids[lo:hi]))[1]
        for stage, (lo, hi) in enumerate(zip(edges, edges[1:]))
    )
    return cut, chosen


def flights(pp: int) -> tuple[int, ...]:
    """The counts of microbatches in flight a recompute cut is made for: from 1F1B's (`pp`) down to
    half of it (fewer in flight trade bubble for memory the levels then need not buy)."""
    return tuple(range(pp, max(1, math.ceil(pp / 2)) - 1, -1))


def memory_bound(cut: Cut, costs: Any, room: Sequence[float]) -> float:
    """Per microbatch, the least step memory allows (Little's law): a microbatch holds its
    chunk's M_B on the chunk's rank at least from its F's end to its I's start, while it goes
    down the rest of the pipeline and back (every later chunk's F and I, a message each way per
    change of rank); a rank holds at most its `room` bytes at once, so a step of m microbatches
    lasts at least m x (sum over its chunks of M_B x that time) / room."""
    held = [0.0] * len(room)
    trip = 0.0  # F and I of every later chunk, and the messages between them
    for chunk in range(cut.stages - 1, -1, -1):
        held[cut.rank_of(chunk)] += costs.mem_b[chunk] * trip
        trip += costs.f[chunk] + costs.i[chunk]
        if chunk and cut.rank_of(chunk) != cut.rank_of(chunk - 1):
            trip += 2 * costs.comm
    return max(h / r for h, r in zip(held, room))
