"""The model as the cut decision sees it, from measured times (`schedules/cut_choice.py`).

Each stage's F, I and W take their measured median (a fused B split into I and W by the static
shares); within an action, each unit (block, or module outside blocks) takes its measured share
(`runtime/block_timing.py`; the static shares where a unit went unmeasured), spread over the
unit's positions (`passes/cut_profile.spread`). What a position costs on another rank: each
rank's *speed* is the median, over the blocks it ran, of measured time over static
FLOP-equivalents (blocks alike compare alike: a layer of a decoder is the same work on every
rank), relative to the fastest rank; a position's time is its measured time divided by its own
rank's speed and multiplied by the other's. Units outside blocks (an embedding, the head, the
loss) keep their measured cost wherever they go, so a first stage slower than its FLOPs say is
seen as such, while a slow rank is seen as slow for every unit.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from zbcompile.passes.cut_profile import (
    KINDS,
    CutLayout,
    flop_equivalents,
    memory_per_position,
    per_position,
    program_work,
    units_of,
)
from zbcompile.schedules.cut_units import CutUnits

Actions = Mapping[tuple[int, str], float]  # (stage, kind) -> median seconds
Units = Mapping[tuple[int, str, str], float]  # (stage, kind, unit) -> median seconds in one action


def _is_block(unit: str) -> bool:
    return any(part.isdigit() for part in unit.split("."))


def _static(programs: Sequence) -> list[dict[str, dict[str, float]]]:
    """Per stage, by kind, each unit's static FLOP-equivalents."""
    result = []
    for program in programs:
        work = program_work(program)
        result.append({k: {u: flop_equivalents(k, f, b) for u, (f, b) in work[k].items()} for k in KINDS})
    return result


def _action_seconds(actions: Actions, static: dict[str, dict[str, float]], stage: int, kind: str) -> float:
    """Measured seconds of `kind` on `stage`; a fused B split into I and W by static shares."""
    if (stage, kind) in actions:
        return actions[(stage, kind)]
    fused = actions.get((stage, "B"))
    if fused is None or kind == "F":
        return 0.0
    i, w = (sum(static[k].values()) for k in ("I", "W"))
    return fused * ((i if kind == "I" else w) / (i + w) if i + w > 0 else 0.5)


def _shares(units: Units, static: dict[str, dict[str, float]], stage: int, kind: str) -> dict[str, float]:
    """Each unit's share of the action: measured where the action's units were, else static."""
    measured = {u: s for (st, k, u), s in units.items() if st == stage and k == kind}
    source = measured if sum(measured.values()) > 0 else static[kind]
    total = sum(source.values())
    return {u: v / total for u, v in source.items()} if total > 0 else {}


def rank_speeds(
    measured: Sequence[dict[str, dict[str, float]]], static: Sequence[dict[str, dict[str, float]]],
    stage_rank: Sequence[int], ranks: int,
) -> list[float]:
    """Per rank, how much slower it runs the same work than the fastest rank (1: the fastest;
    see the module docstring). A rank without blocks compares all its units; one with nothing
    measured counts as the fastest."""
    ratios: list[list[float]] = [[] for _ in range(ranks)]
    fallback: list[list[float]] = [[] for _ in range(ranks)]
    for stage, rank in enumerate(stage_rank):
        for unit in {u for k in KINDS for u in measured[stage][k]}:
            seconds = sum(measured[stage][k].get(unit, 0.0) for k in KINDS)
            work = sum(static[stage][k].get(unit, 0.0) for k in KINDS)
            if seconds > 0 and work > 0:
                (ratios if _is_block(unit) else fallback)[rank].append(seconds / work)
    rho = [statistics.median(r or f) if (r or f) else None for r, f in zip(ratios, fallback)]
    known = [x for x in rho if x is not None]
    fastest = min(known) if known else 1.0
    return [1.0 if x is None else x / fastest for x in rho]


def measured_units(
    layout: CutLayout, programs: Sequence, stage_rank: Sequence[int], ranks: int, actions: Actions, units: Units
) -> tuple[CutUnits, list[float]]:
    """The `CutUnits` of a compile whose stage s ran on rank `stage_rank[s]` with the measured
    `actions` and `units` medians; and each rank's speed (`rank_speeds`)."""
    static = _static(programs)
    measured = [
        {
            k: {u: _action_seconds(actions, static[s], s, k) * x for u, x in _shares(units, static[s], s, k).items()}
            for k in KINDS
        }
        for s in range(len(programs))
    ]
    speeds = rank_speeds(measured, static, stage_rank, ranks)
    own = {k: per_position(layout, [m[k] for m in measured]) for k in KINDS}
    base = {k: [t / speeds[stage_rank[layout.stage_of(p)]] for p, t in enumerate(own[k])] for k in KINDS}
    times = [tuple(tuple(t * speed for t in base[k]) for k in KINDS) for speed in speeds]
    mem_b, mem_w = memory_per_position(layout, programs)
    return units_of(layout, times, mem_b, mem_w), speeds
