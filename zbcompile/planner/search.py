"""The planner's layout search: of every way to lay a model over N GPUs (pipeline stages pp, tensor-
parallel ranks tp inside a node, data-parallel replicas dp keeping their state "replicate" or
"shard", samples per microbatch), with every schedule of the menu and every recompute level, the
fastest predicted step that fits each rank's memory.

A layout's option (schedule, placement, recompute level) is priced on the model's per-position
costs (`units.ModelUnits`, compiled once for all layouts): its stages cut where the slowest
stage is least (`cut_search.bottleneck_cut`), and, where it differs, where each stage also holds
its state and 1F1B's microbatches in flight (one given layout's `menu` also on the cuts where each
stage's recomputation is chosen with it: `memory.recompute_cut`); each stage's costs, each
rank's state (parameters, gradients, optimizer state by data-parallel mode) and the schedule made
and simulated on them (zb-auto and ZBV solved under each rank's memory left after its state).
Branch and bound: options are priced in the order of a bound no schedule can beat (the busiest
rank's summed action time per step) and the search stops where that bound reaches the `keep`-th
best layout found; `exhaustive=True` prices everything (the same answer, for tests).

Assumptions, stated where the report prints: pipeline neighbours talk over the inter-node link;
tp's collectives over the node's; a pipeline has at least two stages and no fewer microbatches
than stages. Pure Python: no torch."""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

from zbcompile.inspect.units import si
from zbcompile.planner.memory import flights, memory_bound, recompute_cut
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.cut_choice import CutSettings, cut_schedule, memory_rule, stage_costs
from zbcompile.schedules.cut_search import Cut, bottleneck_cut
from zbcompile.schedules.cut_units import CutUnits, Segments, candidate_positions
from zbcompile.schedules.memory_limit import DATA_PARALLEL_MODES, state_bytes
from zbcompile.schedules.simulate import simulate

# (schedule, placement): every schedule the runtime runs that trades memory for bubble
MENU: tuple[tuple[str, str], ...] = (
    ("1f1b", "in-line"), ("zb-h1", "in-line"), ("zb-h2", "in-line"), ("zb-auto", "in-line"),
    ("zb-auto", "v"), ("zbv", "v"), ("v-half", "v"), ("v-min", "v"),
)
SOLVED = ("zb-auto", "zbv")  # made under each rank's memory left after its state


class Units(Protocol):
    """What the search reads of a model (`units.ModelUnits`)."""

    tps: tuple[int, ...]
    flops_per_sample: float
    tokens_per_sample: int

    def units(self, tp: int, microbatch_size: int) -> tuple[CutUnits, ...]: ...


@dataclass(frozen=True, order=True)
class Layout:
    """`pp` stages x `tp` ranks each x `dp` replicas keeping their state as `data_parallel` says,
    `microbatches` of `microbatch_size` samples per replica per step."""

    pp: int
    tp: int
    dp: int
    data_parallel: str
    microbatch_size: int
    microbatches: int

    def __str__(self) -> str:
        return (f"pp={self.pp} tp={self.tp} dp={self.dp} ({self.data_parallel}), "
                f"{self.microbatches} microbatches of {self.microbatch_size}")


@dataclass(frozen=True, order=True)
class Option:
    """A schedule of the menu, its placement ("in-line" or "v"), its recompute `level` (0: none)
    or `stage_levels` (one per stage; `level`: their highest); `cut`: "time" (the slowest stage
    least), "memory" (each stage's state and 1F1B's microbatches within its rank's memory too) or
    "recompute" (the cut and each stage's level chosen together for `flight` microbatches in
    flight, packed from the front or `from_back`: `planner/memory.py`; `_Pricer.candidate` fills in the
    levels)."""

    schedule: str
    placement: str
    level: int = 0
    cut: str = "time"
    stage_levels: tuple[int, ...] = ()
    flight: int = 0
    from_back: bool = False

    @property
    def name(self) -> str:
        return f"{self.schedule} (V)" if self.schedule == "zb-auto" and self.placement == "v" else self.schedule


@dataclass(frozen=True)
class Outcome:
    """An option priced: its steady step (`step`: the span, steps back to back), the bound it was
    ordered by (`busy`), each rank's peak bytes (state + activations), whether all fit, why not
    (`error`) where it could not be made, and what was `made` (the schedule, its per-stage costs,
    its cut)."""

    layout: Layout
    option: Option
    step: float
    busy: float
    peaks: tuple[float, ...] = ()
    fits: bool = False
    error: str = ""
    made: Any = field(default=None, compare=False, repr=False)

    def key(self) -> tuple:
        return (self.step, self.layout, self.option)


@dataclass(frozen=True)
class SearchSettings:
    """The question: `gpus` GPUs, `gpus_per_node` to a node, `global_batch` samples per step,
    `memory_limit` bytes per GPU, `optimizer_factor` / `grad_factor` bytes of optimizer state and
    gradients per parameter byte, the `data_parallel` modes and `microbatch_sizes` to try (default:
    powers of two up to 8), the `menu`, the recompute `levels` (default: all the units have), how
    many layouts to `keep`, and zb-auto's `time_budget` per option."""

    gpus: int
    global_batch: int
    memory_limit: float
    link_bandwidth: float
    gpus_per_node: int = 8
    optimizer_factor: float = 2.0
    grad_factor: float = 1.0
    data_parallel: tuple[str, ...] = DATA_PARALLEL_MODES
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    menu: tuple[tuple[str, str], ...] = MENU
    levels: tuple[int, ...] | None = None
    keep: int = 5
    allreduce_seconds_per_byte: Any = None  # (dp) -> seconds per byte of a ring all-reduce over dp ranks
    time_budget: float = 0.0  # zb-auto's solver seconds per option (0: its heuristic)

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "gpus_per_node", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"layout search: {name} must be a positive int, got {value!r}")
        if unknown := set(self.data_parallel) - set(DATA_PARALLEL_MODES):
            raise ValueError(f"layout search: data_parallel modes are {DATA_PARALLEL_MODES}, got {sorted(unknown)}")


@dataclass
class SearchResult:
    """The best layouts (`ranked`: each layout's fastest fitting option, fastest first), every
    option priced (`priced`), the layouts dropped before pricing and why (`dropped`: (layout or
    description, reason)), how many options the bound spared (`pruned`), and the time taken."""

    settings: SearchSettings
    ranked: list[Outcome]
    priced: list[Outcome]
    dropped: list[tuple[str, str]]
    pruned: int
    options: int
    seconds: float = 0.0
    flops_per_sample: float = 0.0
    tokens_per_sample: int = 1
    peak_flops: float = 0.0

    @property
    def best(self) -> Outcome | None:
        return self.ranked[0] if self.ranked else None


def replica_cut_settings(
    microbatches: int, dp: int, data_parallel: str, grad_factor: float, optimizer_factor: float,
    comm_per_byte: float, allreduce_per_byte: float, limits: Sequence[float],
    time_budget: float = CutSettings.time_budget,
) -> CutSettings:
    """The cut decision's settings for `dp` replicas keeping their state `data_parallel`: state
    bytes per parameter byte; each stage's gradient reduction after its last W, a ring all-reduce
    (`allreduce_per_byte` seconds per byte) or under "shard" a reduce-scatter, half of it."""
    share = 1.0 if data_parallel == "replicate" else 0.5
    return CutSettings(
        microbatches=microbatches, comm_per_byte=comm_per_byte,
        reduce_per_byte=share * grad_factor * allreduce_per_byte,
        state_per_byte=state_bytes(1.0, dp, data_parallel, grad_factor, optimizer_factor)["total"],
        limits=tuple(limits), time_budget=time_budget,
    )


class _OneKind(Segments):
    """Segments of units whose ranks are all of one kind: every rank reads the first's times."""

    def time(self, rank: int, start: int, end: int, kind: int | None = None) -> float:
        return super().time(0, start, end, kind)


@dataclass
class _Pricer:
    """Prices options of layouts on one model's units, caching segments and cuts."""

    model: Units
    settings: SearchSettings
    keep_made: bool = True  # outcomes keep their schedule and costs (a menu's rows; not a search's hundreds)
    _segments: dict = field(default_factory=dict)
    _cuts: dict = field(default_factory=dict)  # -> Cut, or for a recompute cut (Cut, stage levels); None: none packs
    _plain: dict = field(default_factory=dict)  # (layout, option at level 0) -> its outcome

    def segments(self, tp: int, b: int, level: int) -> _OneKind:
        key = (tp, b, level)
        if key not in self._segments:
            units = self.model.units(tp, b)[level]
            self._segments[key] = _OneKind(units, [0, *candidate_positions(units), units.positions])
        return self._segments[key]

    def level_segments(self, tp: int, b: int) -> tuple[Segments, ...]:
        """The units at every recompute level, on level 0's segment bounds."""
        if (key := (tp, b, "levels")) not in self._segments:
            bounds = self.segments(tp, b, 0).bounds
            self._segments[key] = tuple(_OneKind(units, bounds) for units in self.model.units(tp, b))
        return self._segments[key]

    def cut_settings(self, layout: Layout) -> CutSettings:
        s = self.settings
        reduce = s.allreduce_seconds_per_byte(layout.dp) if s.allreduce_seconds_per_byte else 0.0
        return replica_cut_settings(
            layout.microbatches, layout.dp, layout.data_parallel, s.grad_factor, s.optimizer_factor,
            1.0 / s.link_bandwidth, reduce, (s.memory_limit,) * layout.pp,
        )

    def cut(self, layout: Layout, option: Option) -> Cut | None:
        """`option`'s cut of `layout`'s pipeline (module docstring; every uniform recompute level
        takes level 0's); None where none packs."""
        found = self._made_cut(layout, option)
        return found[0] if isinstance(found, tuple) else found

    def _made_cut(self, layout: Layout, option: Option) -> Cut | tuple[Cut, tuple[int, ...]] | None:
        by_memory = option.cut != "time"
        key = (layout.tp, layout.microbatch_size, layout.pp, option.placement,
               (layout.dp, layout.data_parallel) if by_memory else None, option.cut, option.flight, option.from_back)
        if key in self._cuts:
            return self._cuts[key]
        settings, segments = self.cut_settings(layout), self.segments(layout.tp, layout.microbatch_size, 0)
        if option.cut == "recompute":
            self._cuts[key] = recompute_cut(self.level_segments(layout.tp, layout.microbatch_size), layout.pp,
                                            option.placement, settings, option.flight, option.from_back)
        else:
            rule = (memory_rule(segments.units, settings, segments, layout.pp, layout.pp, option.placement == "v")
                    if by_memory else (lambda *_: True))
            positions = bottleneck_cut(segments, layout.pp, option.placement, rule)
            self._cuts[key] = None if positions is None else Cut(option.placement, positions)
        return self._cuts[key]

    def candidate(self, layout: Layout, option: Option) -> tuple[Option, float, Cut, tuple] | None:
        """`option` (a recompute cut's with its stage levels), its bound, its cut and what it makes
        (alike: priced alike); None where no cut packs."""
        if option.cut == "recompute" and (found := self._made_cut(layout, option)) is not None:
            option = replace(option, level=max(found[1]), stage_levels=found[1])
        busy, cut = self.bound(layout, option)
        return None if cut is None else (option, busy, cut, (option.schedule, option.stage_levels or option.level, cut))

    def bound(self, layout: Layout, option: Option) -> tuple[float, Cut | None]:
        """A step no schedule of `option` that fits can beat, and its cut: the busiest rank's
        summed action time, or, where longer, what memory allows (`memory.memory_bound`); inf
        where some rank's state alone passes the limit."""
        cut = self.cut(layout, option)
        if cut is None:
            return math.inf, None
        costs, state = self.stage_costs(layout, option, cut)
        busy = [0.0] * layout.pp
        for stage in range(cut.stages):
            busy[cut.rank_of(stage)] += costs.f[stage] + costs.i[stage] + costs.w[stage]
        room = [self.settings.memory_limit - s for s in state]
        if min(room) <= 0:
            return math.inf, cut
        return layout.microbatches * max(max(busy), memory_bound(cut, costs, room)), cut

    def worth_recomputing(self, layout: Layout, option: Option) -> bool:
        """Whether `option`'s recompute level is priced: level 0 always; another where `option`
        at level 0 does not fit, or is solved (zb-auto, ZBV) and holds some rank within one
        microbatch's activations of the limit (the limit binds: more room may buy a shorter step);
        a recompute cut's levels where the same holds on the memory cut without recomputation."""
        if option.level == 0 and option.cut != "recompute":
            return True
        plain = (replace(option, level=0) if option.cut != "recompute"
                 else Option(option.schedule, option.placement, cut="memory"))
        key = (layout, plain)
        if key not in self._plain:
            busy, cut = self.bound(layout, plain)
            self._plain[key] = self.price(layout, plain, cut, busy) if cut is not None else None
        outcome = self._plain[key]
        if outcome is None or not outcome.fits:
            return True
        if option.schedule not in SOLVED:
            return False
        segments = self.segments(layout.tp, layout.microbatch_size, 0)
        costs, _ = stage_costs(segments.units, self.cut(layout, plain), self.cut_settings(layout), segments)
        return max(outcome.peaks) + max(costs.mem_b) > self.settings.memory_limit

    def price(self, layout: Layout, option: Option, cut: Cut, busy: float) -> Outcome:
        """`option` made and simulated on `layout` (module docstring); level 0's kept."""
        key = (layout, option)
        if self._plain.get(key) is None:
            outcome = self._price(layout, option, cut, busy)
            if option.level:
                return outcome
            self._plain[key] = outcome
        return self._plain[key]

    def stage_costs(self, layout: Layout, option: Option, cut: Cut) -> tuple[Any, list[float]]:
        """Each stage's costs at its level and each rank's state bytes (`stage_costs`; per stage,
        with the largest transient of its stages' levels)."""
        settings = self.cut_settings(layout)
        levels = option.stage_levels or (option.level,) * cut.stages
        by_level = {}
        for level in set(levels):
            segments = self.segments(layout.tp, layout.microbatch_size, level)
            by_level[level] = stage_costs(segments.units, cut, settings, segments)
        if len(by_level) == 1:
            return by_level[levels[0]]

        def pick(name: str) -> list[float]:
            return [getattr(by_level[level][0], name)[s] for s, level in enumerate(levels)]

        costs = replace(by_level[levels[0]][0], **{n: pick(n) for n in ("f", "i", "w", "mem_b", "mem_w")})
        state = [
            max(by_level[levels[s]][1][rank] for s in range(cut.stages) if cut.rank_of(s) == rank)
            for rank in range(cut.ranks())
        ]
        return costs, state

    def mixed_levels(self, outcome: Outcome) -> Outcome | None:
        """A solved schedule (zb-auto, ZBV) fitting at one recompute level, made faster by
        recomputing less per stage, as `recompute="auto"` chooses: from the last stage to the
        first, each level lowered while the schedule fits and its step shortens, in passes until
        none does (a greedy order: ordering by each rank's room found slower steps). None where
        nothing shortens it."""
        option, layout = outcome.option, outcome.layout
        if option.schedule not in SOLVED or not option.level or not outcome.fits or option.stage_levels:
            return None
        cut = self.cut(layout, option)
        levels, best, improved = [option.level] * cut.stages, outcome, True
        while improved:
            improved = False
            for stage in reversed(range(cut.stages)):
                while levels[stage] > 0:
                    trial_levels = (*levels[:stage], levels[stage] - 1, *levels[stage + 1:])
                    trial = self.price(layout, replace(option, stage_levels=trial_levels), cut, outcome.busy)
                    if not (trial.fits and trial.step < best.step * (1 - 1e-9)):
                        break
                    levels, best, improved = list(trial_levels), trial, True
        return best if best is not outcome else None

    def _price(self, layout: Layout, option: Option, cut: Cut, busy: float) -> Outcome:
        costs, state = self.stage_costs(layout, option, cut)
        limit = self.settings.memory_limit
        unit = max([*costs.mem_b, 1.0])
        scaled = replace(costs, mem_b=[b / unit for b in costs.mem_b], mem_w=[w / unit for w in costs.mem_w])
        room = [(limit - s) / unit for s in state]
        if min(room) <= 0:
            rank = room.index(min(room))
            return Outcome(layout, option, math.inf, busy, tuple(state), False,
                           f"rank {rank}'s state ({si(state[rank], 'B')}) passes the memory limit")
        try:
            schedule = cut_schedule(option.schedule, cut, scaled, layout.microbatches,
                                    room if option.schedule in SOLVED else None, time_budget=self.settings.time_budget)
        except ValueError as error:
            return Outcome(layout, option, math.inf, busy, error=str(error).splitlines()[0])
        result = simulate(schedule, resolved := resolve_costs(scaled, schedule.stages))
        peaks = tuple(s + p * unit for s, p in zip(state, result.peak_memory))
        made = (schedule, resolved, cut) if self.keep_made else None
        return Outcome(layout, option, result.span, busy, peaks, all(p <= limit for p in peaks), made=made)


def layouts(model: Units, settings: SearchSettings, positions: int) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every layout of `settings.gpus` the search prices, and those it drops with the reason."""
    s = settings
    found: list[Layout] = []
    dropped: list[tuple[str, str]] = []
    for tp in sorted(model.tps):
        if s.gpus_per_node % tp or s.gpus % tp:
            dropped.append((f"tp={tp}", f"does not divide the {s.gpus_per_node} GPUs of a node or the {s.gpus} GPUs"))
            continue
        for pp in range(2, s.gpus // tp + 1):
            if (s.gpus // tp) % pp:
                continue
            if pp > positions:
                dropped.append((f"pp={pp} tp={tp}", f"more stages than the model's {positions} positions"))
                continue
            dp = s.gpus // (tp * pp)
            for b in s.microbatch_sizes:
                if s.global_batch % (dp * b):
                    dropped.append((f"pp={pp} tp={tp} dp={dp}, microbatches of {b}",
                                    f"the global batch {s.global_batch} is not a multiple of dp x {b}"))
                    continue
                m = s.global_batch // (dp * b)
                if m < pp:
                    dropped.append((f"pp={pp} tp={tp} dp={dp}, microbatches of {b}",
                                    f"{m} microbatches for {pp} stages"))
                    continue
                for mode in s.data_parallel if dp > 1 else ("replicate",):
                    found.append(Layout(pp, tp, dp, mode, b, m))
    return found, dropped


def options_of(settings: SearchSettings, levels: int, pp: int, recompute_cuts: bool = False) -> list[Option]:
    """Every option of the menu at every recompute level, each on both cuts, and with
    `recompute_cuts` where the units have recompute levels, on the recompute cuts too (each count
    in flight of `memory.flights`, packed from either end)."""
    chosen = settings.levels if settings.levels is not None else tuple(range(levels))
    uniform = [Option(name, placement, level, cut) for name, placement in settings.menu for level in chosen
               for cut in ("time", "memory")]
    if len(chosen) < 2 or not recompute_cuts:
        return uniform
    return uniform + [Option(name, placement, cut="recompute", flight=flight, from_back=back)
                      for name, placement in settings.menu for flight in flights(pp) for back in (False, True)]


def search(model: Units, settings: SearchSettings, exhaustive: bool = False) -> SearchResult:
    """The `settings.keep` fastest layouts that fit (module docstring)."""
    started = time.perf_counter()
    pricer = _Pricer(model, settings, keep_made=False)
    sample = model.units(min(model.tps), 1)
    found, dropped = layouts(model, settings, sample[0].positions)
    heap: list[tuple[float, int, Layout, Option, Cut]] = []
    count = 0
    for layout in found:
        seen: set[tuple] = set()
        for option in options_of(settings, len(sample), layout.pp):
            made = pricer.candidate(layout, option)
            if made is None or made[1] == math.inf or made[3] in seen:
                continue  # no cut packs, the state alone passes the limit, or the memory cut is the time cut
            seen.add(made[3])
            heap.append((made[1], count, layout, made[0], made[2]))
            count += 1
        if not seen:
            dropped.append((str(layout), "some rank's state alone passes the memory limit under every option"))
    heapq.heapify(heap)
    priced: list[Outcome] = []
    best: dict[Layout, Outcome] = {}
    spared = 0  # recompute levels not worth pricing
    while heap:
        bound, _, layout, option, cut = heap[0]
        if not exhaustive and len(best) >= settings.keep:
            if bound >= sorted(o.step for o in best.values())[settings.keep - 1]:
                break
        heapq.heappop(heap)
        if not pricer.worth_recomputing(layout, option):
            spared += 1
            continue
        outcome = pricer.price(layout, option, cut, bound)
        priced.append(outcome)
        if outcome.fits and (layout not in best or outcome.key() < best[layout].key()):
            best[layout] = outcome
    ranked = sorted(best.values(), key=Outcome.key)[: settings.keep]
    for layout in found:
        mine = [o for o in priced if o.layout == layout]
        if layout not in best and mine:
            reasons = sorted({o.error or "over the memory limit" for o in mine})
            dropped.append((str(layout), "nothing fits: " + "; ".join(reasons[:2])))
    return SearchResult(
        settings, ranked, priced, dropped, len(heap) + spared, count, time.perf_counter() - started,
        model.flops_per_sample, model.tokens_per_sample,
    )


def menu(model: Units, settings: SearchSettings, layout: Layout, refined: bool = True) -> list[Outcome]:
    """Every option of the menu priced on one `layout`: per schedule and placement, on the cut where
    it is faster, at level 0 and each recompute level worth pricing (`_Pricer.worth_recomputing`);
    `refined` also per stage where faster (`_Pricer.mixed_levels`) and on the recompute cuts
    (`planner/memory.py`) in the order of their bound, each where it beats its schedule's fastest fit
    (most of a menu's time: without them a menu prices the uniform levels only)."""
    pricer = _Pricer(model, settings)
    levels = len(model.units(layout.tp, layout.microbatch_size))
    candidates: list[tuple[bool, float, Option, Cut]] = []
    seen: set[tuple] = set()
    for option in options_of(settings, levels, layout.pp, refined):
        if (made := pricer.candidate(layout, option)) is not None and made[3] not in seen:
            seen.add(made[3])
            candidates.append((made[0].cut == "recompute", made[1], made[0], made[2]))
    priced: dict[tuple, Outcome] = {}
    for by_cut, busy, option, cut in sorted(candidates, key=lambda c: (c[0], c[1] if c[0] else 0.0)):
        key = (option.schedule, option.placement, "recompute cut" if by_cut else option.level)
        fastest = min((o.step for k, o in priced.items() if k[:2] == key[:2] and o.fits), default=math.inf)
        if not pricer.worth_recomputing(layout, option) or (by_cut and busy >= fastest):
            continue
        outcome = pricer.price(layout, option, cut, busy)
        if key not in priced or (outcome.fits, -outcome.step) > (priced[key].fits, -priced[key].step):
            priced[key] = outcome
    for schedule, placement in settings.menu if refined else ():  # the fastest fitting level, per stage
        fitting = [o for k, o in priced.items()
                   if k[:2] == (schedule, placement) and k[2] in range(1, levels) and o.fits]
        if fitting and (mixed := pricer.mixed_levels(min(fitting, key=Outcome.key))) is not None:
            priced[(schedule, placement, "per stage")] = mixed
    return list(priced.values())


def worth_recomputing(model: Units, settings: SearchSettings, layout: Layout, level: int = 1) -> bool:
    """Whether `menu` would price some option of `layout` at recompute `level` (where the units
    have no such level: whether they should)."""
    pricer = _Pricer(model, settings)
    return any(pricer.cut(layout, option) is not None and pricer.worth_recomputing(layout, replace(option, level=level))
               for option in options_of(replace(settings, levels=(0,)), 1, layout.pp))
