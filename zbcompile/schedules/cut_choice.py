"""Where to cut a model into pipeline stages, by the predicted step time: the one decision the
planner (`zbcompile plan`, static costs on each rank's hardware, state and activations against
the device's memory) and the runtime (measured per-block times on each rank, activations against
`memory_limit`) both make.

Each candidate cut (`cut_search.py`: in-line, one stage per rank, and a V of two chunks per
rank) gets its stages' costs summed from the positions' times on the rank that would run them,
its message time from the bytes its boundaries cross (a V's tip stays on its rank), its gradient
reduction from its parameters' bytes, and each rank's memory left after its state; zb-auto is
solved for it under that memory (the heuristic for every candidate and its neighbours, then the
full solver on a shortlist and on the cut in use), and its objective value is the prediction. The
best cut is chosen where it beats the cut in use by more than the threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .costs import Costs, resolve_costs
from .cut_search import PLACEMENT_NAMES, Cut, bottleneck_cut, neighbours
from .cut_units import CutUnits, Segments, segments_of
from .ir import Schedule
from .registry import make_schedule

RECUT_THRESHOLD = 0.03  # the predicted gain a new cut must bring over the one in use


@dataclass(frozen=True)
class CutSettings:
    """How cuts are predicted: `microbatches` and the `objective` zb-auto solves for;
    `placements` the cuts considered ("in-line", "v"); a message takes `comm_per_byte` seconds
    per byte the boundary crosses; every action `action_host` seconds of the runtime's own time
    (between actions: posting messages, bookkeeping; a V runs twice the actions of in-line); a
    stage's gradient reduction `reduce_per_byte` per byte of its parameters; a rank holds
    `state_per_byte` bytes of state per byte of its parameters (0: its limit counts activations
    alone) within `limits` (bytes per rank; None: no limit). zb-auto gets
    `time_budget` seconds (deterministic work) on the shortlist of `shortlist` cuts, after
    `climb_rounds` rounds of moving single boundaries."""

    microbatches: int
    placements: tuple[str, ...] = ("in-line",)
    objective: str = "span"
    comm_per_byte: float = 0.0
    action_host: float = 0.0
    reduce_per_byte: float = 0.0
    state_per_byte: float = 0.0
    limits: tuple[float, ...] | None = None
    time_budget: float = 0.2
    shortlist: int = 3
    climb_rounds: int = 2

    def __post_init__(self) -> None:
        unknown = set(self.placements) - set(PLACEMENT_NAMES)
        if unknown or not self.placements:
            raise ValueError(f"CutSettings placements must be among {PLACEMENT_NAMES}, got {self.placements}")


@dataclass(frozen=True)
class CutPrediction:
    """A cut's predicted step (`value`: zb-auto's objective, inf where no schedule fits), the
    stage (chunk) costs it was solved with, each rank's state bytes and the schedule zb-auto
    chose (`schedule`: its name and source)."""

    cut: Cut
    value: float
    costs: Costs
    state_bytes: tuple[float, ...]
    schedule: str = ""
    error: str = ""


@dataclass(frozen=True)
class CutDecision:
    """The cut in use (`current`) and the one chosen, with every candidate's prediction
    (`candidates`, best first) and why (`reason`)."""

    current: CutPrediction
    chosen: CutPrediction
    candidates: tuple[CutPrediction, ...] = field(default=())
    threshold: float = RECUT_THRESHOLD
    reason: str = ""

    @property
    def changes(self) -> bool:
        return self.chosen.cut != self.current.cut

    @property
    def gain(self) -> float:
        """Predicted step time of the cut in use over the chosen one's (1: no change)."""
        if self.chosen.value == math.inf:
            return 1.0
        return self.current.value / self.chosen.value if self.chosen.value > 0 else 1.0


def _stage_ranges(cut: Cut, units: CutUnits) -> list[tuple[int, int]]:
    bounds = cut.bounds(units.positions)
    return list(zip(bounds, bounds[1:]))


def stage_costs(units: CutUnits, cut: Cut, settings: CutSettings, segments: Segments) -> tuple[Costs, list[float]]:
    """The cut's per-stage (per-chunk) costs, memory in bytes, and each rank's state bytes (with
    the largest transient of its stages' actions: memory the schedule cannot use either)."""
    ranges = _stage_ranges(cut, units)
    ranks = cut.ranks()
    f, i, w, mem_b, mem_w, reduce = [], [], [], [], [], []
    held: list[set[int]] = [set() for _ in range(ranks)]
    transient = [0.0] * ranks
    for stage, (start, end) in enumerate(ranges):
        rank = cut.rank_of(stage)
        f.append(segments.time(rank, start, end, 0) + settings.action_host)
        i.append(segments.time(rank, start, end, 1) + settings.action_host)
        w.append(segments.time(rank, start, end, 2) + settings.action_host)
        b, ww, extra = segments.memory(start, end)
        transient[rank] = max(transient[rank], extra)
        mem_b.append(b)
        mem_w.append(ww)
        params = segments.params_of(start, end)
        held[rank] |= params
        reduce.append(settings.reduce_per_byte * segments.param_bytes(params))
    crossing = [units.crossing[p] for k, p in enumerate(cut.positions) if cut.rank_of(k) != cut.rank_of(k + 1)]
    comm = settings.comm_per_byte * max(crossing, default=0.0)
    state = [settings.state_per_byte * segments.param_bytes(ids) + extra for ids, extra in zip(held, transient)]
    return Costs(f=f, i=i, w=w, comm=comm, mem_b=mem_b, mem_w=mem_w, reduce=reduce), state


def predict(
    units: CutUnits, cut: Cut, settings: CutSettings, segments: Segments, time_budget: float | None = None
) -> CutPrediction:
    """zb-auto's objective for `cut` under its predicted costs and each rank's memory left after
    its state (`settings.limits`); inf, with the reason, where no schedule fits."""
    costs, state = stage_costs(units, cut, settings, segments)
    budget = settings.time_budget if time_budget is None else time_budget
    unit = max([*costs.mem_b, 1.0])
    scaled = replace(costs, mem_b=[b / unit for b in costs.mem_b], mem_w=[w / unit for w in costs.mem_w])
    limits = None
    if settings.limits is not None:
        limits = [(limit - s) / unit for limit, s in zip(settings.limits, state)]
        if min(limits) <= 0:
            rank = limits.index(min(limits))
            return CutPrediction(cut, math.inf, costs, tuple(state), error=f"rank {rank}'s state passes its limit")
    try:
        schedule = cut_schedule("zb-auto", cut, scaled, settings.microbatches, limits, settings.objective, budget)
    except ValueError as error:
        return CutPrediction(cut, math.inf, costs, tuple(state), error=str(error).splitlines()[0])
    label = schedule.info.get("v_source", schedule.name)
    return CutPrediction(cut, float(schedule.info["value"]), costs, tuple(state), label)


def cut_schedule(
    name: str, cut: Cut, costs: Costs, microbatches: int, memory_limit: list[float] | None, objective: str = "span",
    time_budget: float = 0.0,
) -> Schedule:
    """Schedule `name` over `cut`'s stages (a V's chunks: "zbv", "v-half", "v-min", or zb-auto
    placed as `cut` is) with their `costs` (memory in `memory_limit`'s unit; the limit binds the
    solved schedules), deterministic and unchecked. ValueError where it cannot be made."""
    arguments = dict(
        memory_limit=memory_limit, objective=objective, time_budget=time_budget, deterministic=True, check=False
    )
    if name != "zb-auto":
        return make_schedule(name, cut.stages, microbatches, costs, **arguments)
    if cut.placement == "v":
        chunks = resolve_costs(costs, cut.stages)
        return make_schedule(
            "zb-auto", cut.ranks(), microbatches, chunks.merged(2), chunk_costs=chunks, placements=("v",), **arguments
        )
    return make_schedule("zb-auto", cut.stages, microbatches, costs, placements=("in-line",), **arguments)


def memory_rule(units: CutUnits, settings: CutSettings, segments: Segments, ranks: int, mult: int | None, v: bool):
    """A `cut_search.MemoryRule` for `mult` microbatches in flight (capped by 1F1B's count per
    stage); every stage fits where no limit is given or `mult` is None."""
    if settings.limits is None or mult is None:
        return lambda *_: True
    bounds = segments.bounds

    def fits(stage: int, rank: int, lo: int, hi: int, params: frozenset[int]) -> bool:
        mem_b, mem_w, extra = segments.memory(bounds[lo], bounds[hi])
        flight = min(mult, ranks if v else ranks - stage)
        share = 0.5 if v else 1.0
        state = settings.state_per_byte * segments.param_bytes(params) + extra
        need = state + flight * mem_b + max(0.0, mem_w - mem_b)
        return need <= share * settings.limits[rank]

    return fits


def candidate_cuts(units: CutUnits, current: Cut, settings: CutSettings, segments: Segments) -> list[Cut]:
    """The cut in use and the least-bottleneck cuts (`cut_search.bottleneck_cut`) of every allowed
    placement, packed from either end, for counts of microbatches in flight from 1 to 1F1B's
    (powers of two) where a limit is given."""
    ranks = current.ranks()
    # microbatches in flight a stage must hold: 1, 2, 4, ... and 1F1B's most (p), where a limit is given
    flights = sorted({*(1 << k for k in range(ranks.bit_length())), ranks})
    mults: list[int | None] = [None] + (flights if settings.limits is not None else [])
    found = [current]
    for placement in settings.placements:
        if placement == "v" and units.positions < 2 * ranks:
            continue
        for mult in mults:
            rule = memory_rule(units, settings, segments, ranks, mult, placement == "v")
            for backward in (False, True):
                positions = bottleneck_cut(segments, ranks, placement, rule, backward)
                if positions is not None:
                    found.append(Cut(placement, positions))
    return list(dict.fromkeys(found))


def choose_cut(
    units: CutUnits, current: Cut, settings: CutSettings, threshold: float = RECUT_THRESHOLD
) -> CutDecision:
    """The cut to run (see the module docstring): the best predicted candidate where it beats
    `current` by more than `threshold`, else `current`."""
    units = replace(units, preferred=tuple(sorted({*units.preferred, *current.positions})))
    segments = segments_of(units)
    found = candidate_cuts(units, current, settings, segments)
    screened = {c: predict(units, c, settings, segments, 0.0) for c in found}
    for _ in range(settings.climb_rounds):
        best = min(screened.values(), key=lambda p: p.value)
        fresh = [c for c in neighbours(best.cut, segments) if c not in screened]
        screened.update({c: predict(units, c, settings, segments, 0.0) for c in fresh})
        if min(screened.values(), key=lambda p: p.value) is best:
            break
    ranked = sorted((p for p in screened.values() if p.cut != current and p.value < math.inf), key=lambda p: p.value)
    solved = [predict(units, p.cut, settings, segments) for p in ranked[: settings.shortlist]]
    now = predict(units, current, settings, segments)
    everything = sorted([now, *solved], key=lambda p: p.value)
    best = everything[0]
    others = tuple(sorted([*solved, *ranked[settings.shortlist :]], key=lambda p: p.value))
    if best is now or best.value == math.inf:
        reason = f"the cut in use is predicted best ({_seconds(now.value)})"
        return CutDecision(now, now, others, threshold, reason)
    gain = now.value / best.value
    if gain - 1 <= threshold:
        reason = (
            f"{best.cut} predicts {_seconds(best.value)} against {_seconds(now.value)}: a gain of {gain - 1:.1%}, "
            f"not above the threshold {threshold:.0%}"
        )
        return CutDecision(now, now, others, threshold, reason)
    why = "the cut in use does not fit its memory" if now.value == math.inf else f"{gain - 1:.1%} faster"
    reason = f"{best.cut} ({best.schedule}) predicts {_seconds(best.value)} against {_seconds(now.value)}: {why}"
    return CutDecision(now, best, others, threshold, reason)


def _seconds(value: float) -> str:
    return "nothing fits" if value == math.inf else f"{value:.4g}"


__all__ = ["Cut", "CutDecision", "CutPrediction", "CutSettings", "CutUnits", "choose_cut", "predict", "stage_costs"]
