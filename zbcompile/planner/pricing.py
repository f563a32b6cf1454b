"""The planner's prices: a layout (`Layout`) and an option of the menu (`Option`: schedule,
placement, recompute level, cut) made and simulated on a model's per-position costs
(`units.ModelUnits`), and the bound no schedule of an option can beat. `Pricer` caches the
segments and cuts of one search or menu; `Solves` the schedules made, shared by every menu and
search of one plan (the same stages, costs and room solve once). Pure Python: no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

from zbcompile.inspect.units import si
from zbcompile.planner.memory import memory_bound, recompute_cut
from zbcompile.schedules.costs import Costs, ResolvedCosts, resolve_costs
from zbcompile.schedules.cut_choice import CutSettings, cut_schedule, memory_rule, stage_costs
from zbcompile.schedules.cut_search import Cut, bottleneck_cut
from zbcompile.schedules.cut_units import CutUnits, Segments, candidate_positions
from zbcompile.schedules.ir import Schedule
from zbcompile.schedules.memory_limit import DATA_PARALLEL_MODES, state_bytes
from zbcompile.schedules.simulate import simulate

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
    flight, packed from the front or `from_back`: `planner/memory.py`; `Pricer.candidate` fills in the
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
class Pricer:
    """Prices options of layouts on one model's units, caching segments and cuts."""

    model: Units
    settings: SearchSettings
    keep_made: bool = True  # outcomes keep their schedule and costs (a menu's rows; not a search's hundreds)
    _segments: dict = field(default_factory=dict)
    _cuts: dict = field(default_factory=dict)  # -> Cut, or for a recompute cut (Cut, stage levels); None: none packs
    _plain: dict = field(default_factory=dict)  # (layout, option at level 0) -> its outcome
    _stage_costs: dict = field(default_factory=dict)  # (tp, b, level, cut, cut settings) -> stage_costs
    solves: "Solves" = field(default_factory=lambda: Solves())

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
            key = (layout.tp, layout.microbatch_size, level, cut, settings)
            if key not in self._stage_costs:
                segments = self.segments(layout.tp, layout.microbatch_size, level)
                self._stage_costs[key] = stage_costs(segments.units, cut, settings, segments)
            by_level[level] = self._stage_costs[key]
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

    def floor(self, layout: Layout, option: Option, bound: float, refined: bool) -> float:
        """A step no outcome grown from `option` (its `bound`) can beat: `bound`, or where `refined`
        also lowers a solved schedule's uniform recompute level per stage (`mixed_levels`), the
        least of it and the busiest rank's summed action time, each stage at its fastest level."""
        if not (refined and option.schedule in SOLVED and option.level and option.cut != "recompute"):
            return bound
        cut = self.cut(layout, option)
        levels = range(len(self.model.units(layout.tp, layout.microbatch_size)))
        at = [self.stage_costs(layout, replace(option, level=k, stage_levels=()), cut)[0] for k in levels]
        busy = [0.0] * layout.pp
        for stage in range(cut.stages):
            busy[cut.rank_of(stage)] += min(c.f[stage] + c.i[stage] + c.w[stage] for c in at)
        return min(bound, layout.microbatches * max(busy))

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
                    trial_option = replace(option, stage_levels=trial_levels)
                    if self.bound(layout, trial_option)[0] >= best.step * (1 - 1e-9):
                        break  # it cannot shorten the step: spared its solve
                    trial = self.price(layout, trial_option, cut, outcome.busy)
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
            solved = self.solves.solve(option.schedule, cut, scaled, layout.microbatches,
                                       room if option.schedule in SOLVED else None, self.settings.time_budget,
                                       self.keep_made)
        except ValueError as error:
            return Outcome(layout, option, math.inf, busy, error=str(error))
        peaks = tuple(s + p * unit for s, p in zip(state, solved.peak_memory))
        made = (solved.schedule, solved.costs, cut) if self.keep_made else None
        return Outcome(layout, option, solved.span, busy, peaks, all(p <= limit for p in peaks), made=made)


@dataclass(frozen=True)
class Solved:
    """A schedule made and simulated: its steady step (`span`), each rank's peak activations (in
    its costs' memory unit), and, where kept, the schedule and its resolved costs."""

    span: float
    peak_memory: tuple[float, ...]
    schedule: Schedule | None = None
    costs: ResolvedCosts | None = None
    v_source: str = ""  # zb-auto over a V: the V schedule it chose


class Solves:
    """Schedules made (`cut_choice.cut_schedule`) and simulated, by what makes them: the schedule,
    its cut's placement and stages, the per-stage costs, the microbatches, each rank's room (for
    the solved schedules) and zb-auto's time budget. One per plan, shared by its menus and
    searches; `solved` and `reused` count the solves made and spared."""

    def __init__(self) -> None:
        self._made: dict[tuple, Solved | str] = {}
        self.solved = 0
        self.reused = 0

    def solve(self, name: str, cut: Cut, costs: Costs, microbatches: int, room: Sequence[float] | None,
              time_budget: float, keep: bool = True) -> Solved:
        """`name` made on `cut` with `costs` under `room` and simulated, or read where made before
        (the schedule kept with `keep`); ValueError (its message's first line) where it cannot be
        made."""
        resolved = resolve_costs(costs, cut.stages)
        key = (name, cut.placement, cut.stages, resolved, microbatches, None if room is None else tuple(room),
               time_budget)
        found = self._made.get(key)
        if found is None and name == "zbv" and (found := self._zbv_of_zb_auto(key, keep)) is not None:
            self._made[key] = found
        if found is None or (keep and isinstance(found, Solved) and found.schedule is None):
            self.solved += 1
            try:
                schedule = cut_schedule(name, cut, costs, microbatches, None if room is None else list(room),
                                        time_budget=time_budget)
            except ValueError as error:
                found = str(error).splitlines()[0]
            else:
                made_costs = resolve_costs(costs, schedule.stages)
                result = simulate(schedule, made_costs)
                kept = (schedule, made_costs) if keep else (None, None)
                found = Solved(result.span, tuple(result.peak_memory), *kept, schedule.info.get("v_source", ""))
            self._made[key] = found
        else:
            self.reused += 1
        if isinstance(found, str):
            raise ValueError(found)
        return found

    def _zbv_of_zb_auto(self, key: tuple, keep: bool) -> Solved | None:
        """ZBV on a V where zb-auto over the same V, costs and room chose ZBV's schedule (zb-auto's V
        is the best of its candidates, ZBV solved under the same limit among them:
        `v_choice.best_v_schedule`): that schedule, not solved again; None where not known."""
        made = self._made.get(("zb-auto", *key[1:]))
        if not isinstance(made, Solved) or made.v_source != "zbv" or (keep and made.schedule is None):
            return None
        return replace(made, schedule=made.schedule and replace(made.schedule, name="zbv"), v_source="")
