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
and simulated on them (zb-auto and ZBV solved under each rank's memory left after its state;
`pricing.py`). Branch and bound: options are priced in the order of a bound no schedule can beat
(the busiest rank's summed action time per step, or what memory allows) and the search stops
where that bound reaches the `keep`-th best layout found; `exhaustive=True` prices everything
(the same answer, for tests). A given layout's `menu` prunes alike past each schedule's row
without recomputation; `nearest_search` looks tier by tier (knobs changed) within a time budget.
One `Solves` per plan makes each schedule once for all of them.

Assumptions, stated where the report prints: pipeline neighbours talk over the inter-node link;
tp's collectives over the node's; a pipeline has at least two stages and no fewer microbatches
than stages. Pure Python: no torch."""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from zbcompile.planner.memory import flights
from zbcompile.planner.pricing import (
    Layout,
    Option,
    Outcome,
    Pricer,
    SearchSettings,
    Solves,
    Units,
)
from zbcompile.schedules.cut_search import Cut

PROGRESS_AFTER = 3.0  # seconds of a search or menu before it prints a progress line (stderr)


def progress(total: int | None, what: str) -> tqdm:
    """A progress line on stderr counting options priced (of `total` where known), shown once
    `PROGRESS_AFTER` seconds have passed (none for a short search)."""
    return tqdm(total=total, desc=what, unit="option", delay=PROGRESS_AFTER, leave=False)


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


def search(model: Units, settings: SearchSettings, exhaustive: bool = False, solves: Solves | None = None
           ) -> SearchResult:
    """The `settings.keep` fastest layouts that fit (module docstring); `solves`: the plan's
    schedules made so far (`pricing.Solves`), read and added to."""
    started = time.perf_counter()
    pricer = Pricer(model, settings, keep_made=False, solves=solves or Solves())
    found, dropped = layouts(model, settings, model.units(min(model.tps), 1)[0].positions)
    heap, count = _candidates(pricer, found, dropped)
    with progress(None, f"layouts of {settings.gpus} GPUs") as shown:
        priced, best, spared, _ = _bound_and_price(pricer, heap, settings.keep, exhaustive, math.inf, shown)
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


Candidate = tuple[float, int, Layout, Option, Cut]  # bound, order, layout, option, cut


def _candidates(pricer: Pricer, found: list[Layout], dropped: list[tuple[str, str]]) -> tuple[list[Candidate], int]:
    """The options of the layouts `found` with their bounds, a heap (least bound first), and their
    count; a layout no option of which packs is added to `dropped`."""
    levels = len(pricer.model.units(min(pricer.model.tps), 1))
    heap: list[Candidate] = []
    for layout in found:
        seen: set[tuple] = set()
        for option in options_of(pricer.settings, levels, layout.pp):
            made = pricer.candidate(layout, option)
            if made is None or made[1] == math.inf or made[3] in seen:
                continue  # no cut packs, the state alone passes the limit, or the memory cut is the time cut
            seen.add(made[3])
            heap.append((made[1], len(heap), layout, made[0], made[2]))
        if not seen:
            dropped.append((str(layout), "some rank's state alone passes the memory limit under every option"))
    heapq.heapify(heap)
    return heap, len(heap)


def _bound_and_price(
    pricer: Pricer, heap: list[Candidate], keep: int, exhaustive: bool, deadline: float, shown: Any
) -> tuple[list[Outcome], dict[Layout, Outcome], int, bool]:
    """Branch and bound: the `heap`'s options priced, least bound first, until `keep` layouts fit
    and the bound reaches the `keep`-th's step (or the heap is empty, or, where not `exhaustive`,
    the clock passes `deadline`): the outcomes priced, each layout's fastest fit, how many recompute
    levels were not worth pricing, and whether the deadline stopped it (the heap keeps the rest)."""
    priced: list[Outcome] = []
    best: dict[Layout, Outcome] = {}
    spared = 0
    while heap:
        bound, _, layout, option, cut = heap[0]
        if not exhaustive and len(best) >= keep:
            if bound >= sorted(o.step for o in best.values())[keep - 1]:
                return priced, best, spared, False
        if not exhaustive and time.perf_counter() > deadline:
            return priced, best, spared, True
        heapq.heappop(heap)
        shown.update()
        if not pricer.worth_recomputing(layout, option):
            spared += 1
            continue
        outcome = pricer.price(layout, option, cut, bound)
        priced.append(outcome)
        if outcome.fits and (layout not in best or outcome.key() < best[layout].key()):
            best[layout] = outcome
    return priced, best, spared, False


KNOBS = ("pp", "tp", "dp", "data_parallel", "microbatch_size")


def knobs_changed(layout: Layout, near: Layout) -> int:
    """How many of `KNOBS` `layout` sets otherwise than `near`."""
    return sum(getattr(layout, k) != getattr(near, k) for k in KNOBS)


def nearest_search(
    model: Units, settings: SearchSettings, near: Layout, count: int = 3, solves: Solves | None = None,
    seconds: float = math.inf,
) -> tuple[list[Outcome], dict[str, Any]]:
    """The `count` fitting layouts of `settings.gpus` GPUs closest to `near`: fewest `KNOBS`
    changed, then fastest, each at its fastest option of the menu's uniform recompute levels. Tier
    by tier (knobs changed), each by branch and bound, until `count` fit; within `seconds`. With
    them, what the time budget left: {"seconds", "stopped": whether it stopped the search,
    "layouts_skipped": layouts of the tiers not reached or left unpriced}."""
    deadline = time.perf_counter() + seconds
    pricer = Pricer(model, settings, keep_made=False, solves=solves or Solves())
    found, dropped = layouts(model, settings, model.units(min(model.tps), 1)[0].positions)
    tiers: dict[int, list[Layout]] = {}
    for layout in found:
        tiers.setdefault(knobs_changed(layout, near), []).append(layout)
    chosen: list[Outcome] = []
    timed_out, skipped = False, 0
    with progress(None, f"layouts of {settings.gpus} GPUs near {near}") as shown:
        for knobs in sorted(tiers):
            if len(chosen) >= count:
                break
            if timed_out:
                skipped += len(tiers[knobs])
                continue
            heap, _ = _candidates(pricer, tiers[knobs], dropped)
            _, best, _, timed_out = _bound_and_price(pricer, heap, count - len(chosen), False, deadline, shown)
            skipped += len({c[2] for c in heap} - set(best)) if timed_out else 0
            chosen += sorted(best.values(), key=Outcome.key)[: count - len(chosen)]
    return chosen, {"seconds": seconds, "stopped": timed_out, "layouts_skipped": skipped}


def menu(
    model: Units, settings: SearchSettings, layout: Layout, refined: bool = True, solves: Solves | None = None,
    *, keep_made: bool = True, exhaustive: bool = False, rows: bool = True,
) -> list[Outcome]:
    """Every option of the menu that can win, priced on one `layout`: per schedule and placement,
    on the cut where it is faster, at level 0 and each recompute level worth pricing
    (`Pricer.worth_recomputing`); `refined` also per stage where faster (`Pricer.mixed_levels`)
    and on the recompute cuts (`planner/memory.py`). Level 0 is priced for every schedule; the
    rest in the order of their bound (`Pricer.floor`), skipping those whose bound reaches the
    fastest fitting step found (`exhaustive`: none skipped, the recompute cuts all priced;
    without `rows`, where only the fastest fit matters, level 0 is skipped alike). `solves`: the
    plan's schedules made so far, read and added to; `keep_made`: outcomes keep their schedules
    (a menu's rows)."""
    pricer = Pricer(model, settings, keep_made=keep_made, solves=solves or Solves())
    levels = len(model.units(layout.tp, layout.microbatch_size))
    candidates: list[tuple[float, Option, float, Cut]] = []
    seen: set[tuple] = set()
    for option in options_of(settings, levels, layout.pp, refined):
        if (made := pricer.candidate(layout, option)) is not None and made[3] not in seen:
            seen.add(made[3])
            option, busy, cut = made[:3]
            first = rows and option.level == 0 and option.cut != "recompute"  # every schedule's row
            candidates.append((-math.inf if first else pricer.floor(layout, option, busy, refined), option, busy, cut))
    priced: dict[tuple, Outcome] = {}
    fastest = math.inf  # the fastest fitting step priced
    with progress(len(candidates), f"menu of {layout}") as shown:
        for floor, option, busy, cut in sorted(candidates, key=lambda c: c[0]):
            shown.update()
            key = (option.schedule, option.placement, "recompute cut" if option.cut == "recompute" else option.level)
            if not exhaustive and floor >= fastest:
                break
            if not pricer.worth_recomputing(layout, option):
                continue
            outcome = pricer.price(layout, option, cut, busy)
            if key not in priced or (outcome.fits, -outcome.step) > (priced[key].fits, -priced[key].step):
                priced[key] = outcome
            fastest = min(fastest, outcome.step if outcome.fits else math.inf)
    for schedule, placement in settings.menu if refined else ():  # the fastest fitting level, per stage
        fitting = [o for k, o in priced.items()
                   if k[:2] == (schedule, placement) and k[2] in range(1, levels) and o.fits]
        start = min(fitting, key=Outcome.key) if fitting else None
        if start is None or (not exhaustive and pricer.floor(layout, start.option, start.busy, True) >= fastest):
            continue
        if (mixed := pricer.mixed_levels(start)) is not None:
            priced[(schedule, placement, "per stage")] = mixed
            fastest = min(fastest, mixed.step)
    return list(priced.values())


def worth_recomputing(
    model: Units, settings: SearchSettings, layout: Layout, level: int = 1, solves: Solves | None = None
) -> bool:
    """Whether `menu` would price some option of `layout` at recompute `level` (where the units
    have no such level: whether they should)."""
    pricer = Pricer(model, settings, solves=solves or Solves())
    return any(pricer.cut(layout, option) is not None and pricer.worth_recomputing(layout, replace(option, level=level))
               for option in options_of(replace(settings, levels=(0,)), 1, layout.pp))
