"""The planner's cut with recomputation per stage (`zbcompile/planner/memory.py`) on fixed
per-position costs: the cut and levels it finds are those of the least bottleneck that pricing
every cut and every stage's level finds, each stage within its memory."""

import itertools

from zbcompile.planner.memory import flights, recompute_cut
from zbcompile.schedules.cut_choice import CutSettings, memory_rule
from zbcompile.schedules.cut_units import CutUnits, Segments, v_rank

N = 12  # positions
# per level: (F, I, W) seconds per position and M_B bytes per position; more recomputation, less memory
LEVELS = ((1.0, 1.0, 0.7, 1.0), (1.0, 1.3, 0.7, 0.5), (1.0, 1.8, 0.7, 0.1))


def level_units(level, ranks, first_heavier=1.0):
    f, i, w, mem = LEVELS[level]
    scale = [first_heavier if p < 3 else 1.0 for p in range(N)]
    times = ((tuple(f * s for s in scale), tuple(i * s for s in scale), tuple(w * s for s in scale)),) * ranks
    return CutUnits(
        times=times, mem_b=tuple(mem * s for s in scale), mem_w=(0.2,) * N, crossing=(1.0,) * (N + 1),
        allowed=tuple(range(1, N)), params=tuple((10.0, (p,)) for p in range(N)),
    )


def exhaustive(levels, ranks, placement, settings, flight):
    """The least bottleneck over every cut and every stage's level that fits its rule."""
    chunks = 2 * ranks if placement == "v" else ranks
    share = 0.5 if placement == "v" else 1.0
    rules = [memory_rule(s.units, settings, s, ranks, flight, placement == "v") for s in levels]
    best = float("inf")
    for positions in itertools.combinations(range(1, N), chunks - 1):
        edges = [0, *positions, N]
        worst = 0.0
        for stage, (lo, hi) in enumerate(zip(edges, edges[1:])):
            rank = v_rank(stage, ranks) if placement == "v" else stage
            params = frozenset(range(lo, hi))
            times = [s.time(0, lo, hi) / share for k, s in enumerate(levels) if rules[k](stage, rank, lo, hi, params)]
            worst = max(worst, min(times, default=float("inf")))
        best = min(best, worst)
    return best


def test_the_cut_and_levels_are_those_of_the_least_bottleneck_every_stage_within_memory():
    checked = 0
    for placement, ranks in (("in-line", 3), ("v", 2)):
        for limit in (3.0, 6.0, 12.0):
            levels = [Segments(level_units(k, ranks, 1.5), list(range(N + 1))) for k in range(len(LEVELS))]
            settings = CutSettings(microbatches=8, state_per_byte=0.05, limits=(limit,) * ranks)
            for flight in flights(ranks):
                want = exhaustive(levels, ranks, placement, settings, flight)
                found = recompute_cut(levels, ranks, placement, settings, flight)
                if want == float("inf"):
                    assert found is None
                    continue
                cut, chosen = found
                edges = cut.bounds(N)
                share = 0.5 if placement == "v" else 1.0
                got = max(levels[k].time(0, lo, hi) / share for k, (lo, hi) in zip(chosen, zip(edges, edges[1:])))
                assert abs(got - want) <= 1e-6 * want, (placement, limit, flight, got, want)
                rules = [memory_rule(s.units, settings, s, ranks, flight, placement == "v") for s in levels]
                for stage, (k, (lo, hi)) in enumerate(zip(chosen, zip(edges, edges[1:]))):
                    rank = v_rank(stage, ranks) if placement == "v" else stage
                    assert rules[k](stage, rank, lo, hi, frozenset(range(lo, hi)))
                checked += 1
    assert checked >= 6


def bottleneck(levels, cut, chosen):
    edges = cut.bounds(N)
    return max(levels[k].time(0, lo, hi) for k, (lo, hi) in zip(chosen, zip(edges, edges[1:])))


def test_a_tight_limit_recomputes_the_first_stages_only_and_beats_every_uniform_level():
    levels = [Segments(level_units(k, 3), list(range(N + 1))) for k in range(len(LEVELS))]
    settings = CutSettings(microbatches=8, state_per_byte=0.05, limits=(6.0,) * 3)
    cut, chosen = recompute_cut(levels, 3, "in-line", settings, 3)
    assert chosen[0] > chosen[-1] == 0  # the first stage holds 3 microbatches in flight, the last one
    uniform = [recompute_cut([levels[k]], 3, "in-line", settings, 3) for k in range(len(LEVELS))]
    best_uniform = min(bottleneck([levels[k]], *u) for k, u in enumerate(uniform) if u is not None)
    assert bottleneck(levels, cut, chosen) < best_uniform
    free = recompute_cut(levels, 3, "in-line", CutSettings(microbatches=8), 3)
    assert free[1] == (0, 0, 0) and free[0].positions == (4, 8)  # no limit: no recomputation, balanced


def test_flights_run_from_one_f_one_b_to_half_of_it():
    assert flights(8) == (8, 7, 6, 5, 4)
    assert flights(2) == (2, 1)
