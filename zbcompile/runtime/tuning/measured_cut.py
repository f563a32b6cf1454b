"""The model as the cut decision sees it, from measured times (`schedules/cut_choice.py`).

Each stage's F, I and W take their measured median (a fused B split into I and W by the static
shares); within an action, each unit (block, or module outside blocks) takes its measured share
(`runtime/tuning/block_timing.py`; the static shares where a unit went unmeasured), spread over the
unit's positions (`passes/cut_profile.spread`). What a position costs on another rank: each
rank's *speed* compares the blocks alike (the same static work: a decoder's layers) that two
ranks ran, their measured time per static FLOP-equivalent, relative to the fastest rank (blocks
of different kinds are not compared: a kernel faster than its FLOPs say is not a faster rank);
a position's time is its measured time divided by its own rank's speed and multiplied by the
other's. Units outside blocks (an embedding, the head, the
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


def _signature(work: dict[str, dict[str, float]], unit: str) -> tuple[float, ...]:
    """A block's static work per kind, to 4 significant digits: blocks alike have one."""
    return tuple(float(f"{work[k].get(unit, 0.0):.4g}") for k in KINDS)


def rank_speeds(
    measured: Sequence[dict[str, dict[str, float]]], static: Sequence[dict[str, dict[str, float]]],
    stage_rank: Sequence[int], ranks: int,
) -> list[float]:
    """Per rank, how much slower it runs the same work than the fastest rank (1: the fastest;
    see the module docstring): blocks alike (the same static work of every kind) that two ranks
    ran compare them (the median over such blocks of their measured seconds per static
    FLOP-equivalent), rank by rank from the first one that ran a block; ranks no block alike
    compares, by the median ratio over all their blocks (or units, where they ran no block); a
    rank that ran nothing measured counts as fast as the first."""
    alike: dict[tuple[float, ...], dict[int, list[float]]] = {}
    coarse: dict[int, list[float]] = {}  # per rank, every unit's ratio (blocks first)
    for stage, rank in enumerate(stage_rank):
        for unit in sorted({u for k in KINDS for u in measured[stage][k]}, key=lambda u: not _is_block(u)):
            seconds = sum(measured[stage][k].get(unit, 0.0) for k in KINDS)
            work = sum(static[stage][k].get(unit, 0.0) for k in KINDS)
            if seconds > 0 and work > 0 and _is_block(unit):
                alike.setdefault(_signature(static[stage], unit), {}).setdefault(rank, []).append(seconds / work)
            if seconds > 0 and work > 0 and (_is_block(unit) or not any(map(_is_block, measured[stage]["F"]))):
                coarse.setdefault(rank, []).append(seconds / work)
    rho = {kind: {r: statistics.median(v) for r, v in per_rank.items()} for kind, per_rank in alike.items()}
    rho[()] = {}  # where no block alike compares two ranks: all their blocks' (or units') ratios
    first = min([r for per_rank in rho.values() for r in per_rank] + list(coarse), default=0)
    speed = {first: 1.0}
    while True:
        estimates: dict[int, list[float]] = {}
        for per_rank in rho.values():
            known = [r for r in per_rank if r in speed]
            for r in per_rank:
                if r not in speed and known:
                    estimates.setdefault(r, []).extend(speed[k] * per_rank[r] / per_rank[k] for k in known)
        if not estimates:
            if rho[()] or not set(coarse) - set(speed):
                break
            rho[()] = {r: statistics.median(v) for r, v in coarse.items()}
            continue
        speed.update({r: statistics.median(v) for r, v in estimates.items()})
    values = [speed.get(r, 1.0) for r in range(ranks)]
    return [v / min(values) for v in values]


SPEED_NOISE = 0.05
"""Below this, a rank's measured slowness is noise (`agreed_speeds`)."""
MIN_REPETITIONS = 4
"""Fewer repetitions call no rank slower (`agreed_speeds`), only in doubt (`speeds_in_doubt`): the
few steps of one round of calibration can all fall in one spell of other work on the machine
(two equal ranks came out 1.2-1.3x apart that way), so a rank is slower on more than one round's say."""


def agreed_speeds(repeated: Sequence[Sequence[float]], noise: float = SPEED_NOISE) -> list[float]:
    """Each rank's speed from several repeated measurements of the same blocks (`rank_speeds`
    of each): a rank is slower only where at least `MIN_REPETITIONS` repetitions all say so by
    more than the spread between them plus `noise` (the outer quarter at each end set aside: one
    burst among many); then its median; else it is as fast as the fastest (1). Two ranks of one
    kind thus come out equal however one repetition, or one short spell of them, went."""
    agreed = [statistics.median(e) if _agree(e, noise) else 1.0 for e in zip(*repeated)]
    return [v / min(agreed) for v in agreed] if agreed else []


def speeds_in_doubt(repeated: Sequence[Sequence[float]], noise: float = SPEED_NOISE) -> list[int]:
    """The ranks whose repetitions, taken together (their median), say slower by more than
    `noise` while they do not agree on it (`agreed_speeds`), or are too few to: more repetitions
    may settle them."""
    return [r for r, e in enumerate(zip(*repeated)) if statistics.median(e) - 1 > noise and not _agree(e, noise)]


def _agree(estimates: Sequence[float], noise: float) -> bool:
    """Whether there are at least `MIN_REPETITIONS` estimates and every one (the outer quarter at
    each end set aside) says slower by more than the spread between them plus `noise`."""
    if len(estimates) < MIN_REPETITIONS:
        return False
    ordered = sorted(estimates)
    inner = ordered[len(ordered) // 4: len(ordered) - len(ordered) // 4]
    low, high = inner[0], inner[-1]
    return low - 1 > (high - low) / 2 + noise


def measured_units(
    layout: CutLayout, programs: Sequence, stage_rank: Sequence[int], ranks: int, actions: Actions, units: Units,
    speeds: Sequence[float] | None = None,
) -> tuple[CutUnits, list[float]]:
    """The `CutUnits` of a compile whose stage s ran on rank `stage_rank[s]` with the measured
    `actions` and `units` medians; and each rank's speed (`rank_speeds`, unless `speeds` gives
    them, e.g. `agreed_speeds`)."""
    static = _static(programs)
    measured = [
        {
            k: {u: _action_seconds(actions, static[s], s, k) * x for u, x in _shares(units, static[s], s, k).items()}
            for k in KINDS
        }
        for s in range(len(programs))
    ]
    speeds = list(speeds) if speeds is not None else rank_speeds(measured, static, stage_rank, ranks)
    own = {k: per_position(layout, [m[k] for m in measured]) for k in KINDS}
    base = {k: [t / speeds[stage_rank[layout.stage_of(p)]] for p, t in enumerate(own[k])] for k in KINDS}
    times = [tuple(tuple(t * speed for t in base[k]) for k in KINDS) for speed in speeds]
    mem_b, mem_w = memory_per_position(layout, programs)
    return units_of(layout, times, mem_b, mem_w), speeds
