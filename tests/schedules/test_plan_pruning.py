"""The planner's pruned pricing (`zbcompile/planner/search.py`) on fixed per-position costs: a
menu that skips the options whose bound cannot beat the fastest fit found, and a search that stops
at its bound, choose what pricing every option chooses; solves shared through one `Solves` are
made once."""

from zbcompile.planner.pricing import Layout, SearchSettings, Solves
from zbcompile.planner.search import menu, search

N = 12  # positions
# per recompute level: (F, I, W) seconds and M_B bytes per position; more recomputation, less memory
LEVELS = ((1.0, 1.0, 0.7, 1.0), (1.0, 1.3, 0.7, 0.5), (1.0, 1.8, 0.7, 0.1))
MS = 1e-3
GB = 1e9


class TinyUnits:
    """A model of N positions (the first three heavier) at 3 recompute levels, for tp 1 and 2."""

    tps = (1, 2)
    flops_per_sample = 1e12
    tokens_per_sample = 1

    def units(self, tp, microbatch_size):
        from zbcompile.schedules.cut_units import CutUnits

        scale = [(1.5 if p < 3 else 1.0) * microbatch_size / tp for p in range(N)]
        found = []
        for f, i, w, mem in LEVELS:
            kinds = tuple(tuple(x * s * MS for s in scale) for x in (f, i, w))
            found.append(CutUnits(
                times=(kinds,), mem_b=tuple(mem * s * GB for s in scale), mem_w=tuple(0.2 * s * GB for s in scale),
                crossing=(1e6,) * (N + 1), allowed=tuple(range(1, N)),
                params=tuple((2.0 * GB / tp, (p,)) for p in range(N)),
            ))
        return tuple(found)


def settings(limit, **changes):
    return SearchSettings(
        gpus=8, global_batch=16, memory_limit=limit, link_bandwidth=1e11, microbatch_sizes=(1, 2),
        allreduce_seconds_per_byte=lambda dp: 1e-11, keep=3, **changes,
    )


def fastest(outcomes):
    fitting = [o for o in outcomes if o.fits]
    return min(fitting, key=lambda o: o.key()) if fitting else None


def test_the_pruned_menu_chooses_what_pricing_every_option_chooses():
    units, checked, spared = TinyUnits(), 0, 0
    for limit in (22 * GB, 26 * GB, 28 * GB, 34 * GB, 40 * GB, 60 * GB):
        for layout in (Layout(4, 1, 2, "replicate", 1, 8), Layout(2, 2, 2, "shard", 2, 4)):
            solves = Solves()
            pruned = menu(units, settings(limit), layout, solves=solves)
            every = menu(units, settings(limit), layout, exhaustive=True)
            want, got = fastest(every), fastest(pruned)
            assert (got and got.step) == (want and want.step), (limit, layout)
            plain = {(o.option.schedule, o.option.placement) for o in pruned if not o.option.level}
            assert plain == {(o.option.schedule, o.option.placement) for o in every if not o.option.level}
            spared += len(every) - len(pruned)
            checked += want is not None
            again = menu(units, settings(limit), layout, solves=solves)
            assert [o.step for o in again] == [o.step for o in pruned]
    assert checked >= 8 and spared > 0


def test_the_pruned_search_ranks_what_pricing_every_option_ranks():
    units = TinyUnits()
    for limit in (22 * GB, 60 * GB):
        found = search(units, settings(limit))
        every = search(units, settings(limit), exhaustive=True)
        assert [o.key() for o in found.ranked] == [o.key() for o in every.ranked]
        assert found.ranked and len(found.priced) < len(every.priced)


def test_one_solves_makes_each_schedule_once():
    units, solves = TinyUnits(), Solves()
    layout = Layout(4, 1, 2, "replicate", 1, 8)
    menu(units, settings(22 * GB), layout, solves=solves)
    made = solves.solved
    menu(units, settings(22 * GB), layout, solves=solves)
    assert solves.solved == made and solves.reused >= made


def test_the_nearest_layouts_are_those_pricing_every_layout_finds_and_a_budget_says_what_it_left():
    """Fewest knobs changed, then fastest, each at its menu's fastest uniform level: as pricing
    every layout's menu finds them; with no time, the search says it stopped and skipped."""
    from zbcompile.planner.search import knobs_changed, layouts, nearest_search

    units, near = TinyUnits(), Layout(4, 1, 2, "replicate", 1, 8)
    for limit in (30 * GB, 60 * GB):
        found, budget = nearest_search(units, settings(limit), near)
        every = [fastest(menu(units, settings(limit), layout, refined=False))
                 for layout in layouts(units, settings(limit), N)[0]]
        want = sorted((o for o in every if o), key=lambda o: (knobs_changed(o.layout, near), o.key()))[:3]
        assert [o.key() for o in found] == [o.key() for o in want] and not budget["stopped"]
    found, budget = nearest_search(units, settings(30 * GB), near, seconds=0.0)
    assert budget["stopped"] and budget["layouts_skipped"] > 0


def test_zbv_read_from_zb_auto_over_the_same_v_is_zbv_solved():
    """Where zb-auto over a V chose ZBV's schedule, ZBV on the same V is read from it, as solved."""
    from zbcompile.schedules import Costs
    from zbcompile.schedules.cut_search import Cut

    cut, read = Cut("v", tuple(range(1, 8))), 0
    for room in ([3.0] * 4, [5.0] * 4, [8.0] * 4, [2.5, 3.0, 4.0, 6.0]):
        costs = Costs(f=[1.0, 1.1, 0.9, 1.0, 1.2, 1.0, 0.8, 1.0], i=[1.6] * 8, w=[0.9] * 8, comm=0.05,
                      mem_b=[1.0] * 8, mem_w=[0.4] * 8, reduce=[2.0] * 8)
        shared, alone = Solves(), Solves()
        v = shared.solve("zb-auto", cut, costs, 12, room, 0.0)
        zbv = shared.solve("zbv", cut, costs, 12, room, 0.0)
        want = alone.solve("zbv", cut, costs, 12, room, 0.0)
        assert (zbv.span, zbv.peak_memory) == (want.span, want.peak_memory)
        assert zbv.schedule.rows_as_text() == want.schedule.rows_as_text()
        read += v.v_source == "zbv" and shared.solved == 1
    assert read


def test_the_report_says_where_the_budget_stopped_the_nearest_layouts():
    from zbcompile.planner.report import budget_lines

    stopped = {"nearest_budget": {"seconds": 20.0, "stopped": True, "layouts_skipped": 7}}
    assert "time budget, 20 s: 7 layouts not priced" in budget_lines(stopped)[0]
    assert budget_lines({"nearest_budget": {"seconds": 20.0, "stopped": False, "layouts_skipped": 0}}) == []
    assert budget_lines({}) == []
