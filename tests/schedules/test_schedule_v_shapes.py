"""V-shape and looped schedules (v-min, v-half, v-zb, looped-bfs, dualpipev): validator-clean for
p = 2..8 ranks and m = p..4p microbatches; the building blocks' memory and bubble bounds."""

import functools
import math

import pytest

from zbcompile.schedules import Costs, make_schedule, schedule_spec, simulate
from zbcompile.schedules.building_block import INTERVAL, v_half_block, v_min_block, v_zb_block
from zbcompile.schedules.v_choice import PLACEMENTS

pytestmark = pytest.mark.xdist_group("v_shapes")  # one process builds every schedule once (``built``)

NEW = ("v-min", "v-half", "v-zb", "looped-bfs", "dualpipev")
CASES = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
CHUNK = Costs()  # uniform per-chunk costs: F = I = W, M_W = M_B / 2
STAGE = Costs(mem_b=2.0, mem_w=1.0)  # the same model cut into p stages of two chunks each


@functools.cache
def built(name, p, m):
    """``make_schedule`` validates (placement, completeness, order, deadlock, lowering); each
    schedule is built once for all the tests here."""
    return make_schedule(name, 2 * p, m, CHUNK)


@functools.cache
def scored(name, p, m):
    if name in ("1f1b", "zb-h1"):
        return simulate(make_schedule(name, p, m, STAGE), STAGE)
    return simulate(built(name, p, m), CHUNK)


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("name", NEW)
def test_new_schedules_validate(name, p):
    for m in range(p, 4 * p + 1):
        sched = built(name, p, m)
        assert sched.ranks == p and sched.stages == 2 * p and sched.name == name


def _ratio(name, p, m):
    """Peak activation memory over 1F1B's on the same model (p stages of two chunks)."""
    return max(scored(name, p, m).peak_memory) / max(scored("1f1b", p, m).peak_memory)


@pytest.mark.parametrize(("name", "ratio"), [("v-min", 0.40), ("v-half", 0.55), ("v-zb", 1.0)])
def test_building_block_memory(name, ratio):
    """The paper's fractions of 1F1B's memory plus rounding: a rank's peak is at most its chunks'
    lifespans (F to the end of W) over the interval, each rounded up (the building-block
    theorem), which is at most ``ratio`` of 1F1B's plus one microbatch of the rank (M_B)."""
    block = {"v-min": v_min_block, "v-half": v_half_block, "v-zb": v_zb_block}[name]
    for p, m in CASES:
        peaks = scored(name, p, m).peak_memory
        for r, (f0, f1, i1, i0) in enumerate(block(p)):
            # W runs at most two slots after its I in the steady state (two free slots per interval)
            bound = math.ceil((i0 + 3 - f0) / INTERVAL) + math.ceil((i1 + 3 - f1) / INTERVAL)
            assert peaks[r] <= bound, (name, p, m, r)
        assert _ratio(name, p, m) <= ratio + 1 / p + 1e-9, (name, p, m)


def test_v_schedules_order_memory_and_bubble():
    """Less memory costs bubble: v-min < v-half < v-zb in memory, the reverse in bubble; v-zb
    has no more bubble than ZB-H1 at 1F1B's memory."""
    for p, m in CASES:
        res = {n: scored(n, p, m) for n in ("v-min", "v-half", "v-zb")}
        h1 = scored("zb-h1", p, m)
        assert res["v-zb"].stage_bubble_rate <= h1.stage_bubble_rate + 1e-9, (p, m)
        assert max(res["v-min"].peak_memory) <= max(res["v-half"].peak_memory) <= max(res["v-zb"].peak_memory)
        if m >= 2 * p:
            assert (
                res["v-zb"].stage_bubble_rate
                <= res["v-half"].stage_bubble_rate
                <= res["v-min"].stage_bubble_rate + 1e-9
            )


def test_looped_bfs_runs_all_forwards_first():
    sched = make_schedule("looped-bfs", 4, 3)
    assert [str(a) for a in sched.actions[1]] == [
        "1F0",
        "1F1",
        "1F2",
        "3F0",
        "3F1",
        "3F2",
        "3B0",
        "3B1",
        "3B2",
        "1B0",
        "1B1",
        "1B2",
    ]
    assert sched.stage_to_rank == (0, 1, 0, 1)


def test_v_schedules_need_an_even_chunk_count():
    for name in ("v-min", "v-half", "v-zb", "dualpipev"):
        with pytest.raises(ValueError, match="two chunks on each rank"):
            make_schedule(name, 3, 4)


FIXED = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "looped-bfs", "v-min", "v-half", "v-zb", "dualpipev")


@pytest.mark.parametrize(
    ("p", "m", "costs"),
    [
        (4, 8, Costs()),
        (4, 12, Costs(f=[1.0, 1.2, 0.9, 1.1], i=[1.1, 1.0, 1.2, 0.9], w=[0.6, 0.8, 0.7, 0.9], comm=0.05)),
        (6, 12, Costs(f=1.0, i=1.1, w=0.8, comm=0.1, mem_b=1.0, mem_w=0.4)),
    ],
)
@pytest.mark.parametrize("fraction", [0.6, 0.8])
def test_zb_auto_picks_a_v_schedule_below_1f1b_memory(p, m, costs, fraction):
    """With a limit below 1F1B's, zb-auto picks the V placement (the same model in 2p chunks) and
    is never worse than a fixed schedule that fits, of either chunk count; its bound holds."""
    stage_costs = costs.resolve(p)
    limit = fraction * max(simulate(make_schedule("1f1b", p, m, costs), costs).peak_memory)
    auto = make_schedule("zb-auto", p, m, costs, memory_limit=limit, time_budget=0, placements=PLACEMENTS)
    assert auto.info["placement"] == "v" and auto.stages == 2 * p and auto.ranks == p
    chunk_costs = stage_costs.chunked(2)
    value = simulate(auto, chunk_costs).span
    assert auto.info["lower_bound"] <= value + 1e-9
    assert max(simulate(auto, chunk_costs).peak_memory) <= limit + 1e-9
    fitting = 0
    for name in FIXED:
        chunks = p * schedule_spec(name).chunks_per_rank
        sc = stage_costs if chunks == p else chunk_costs
        res = simulate(make_schedule(name, chunks, m, sc, check=False), sc)
        if max(res.peak_memory) <= limit + 1e-9:
            fitting += 1
            assert value <= res.span + 1e-9, name
    assert fitting >= 1


@pytest.mark.parametrize(
    ("p", "m", "costs"),
    [
        (2, 2, Costs()),
        (4, 4, Costs()),
        (4, 4, Costs(comm=0.5)),
        (4, 8, Costs(f=1.0, i=1.1, w=0.8, comm=0.1, mem_b=1.0, mem_w=0.4)),
        (3, 6, Costs(f=[1.0, 2.0, 1.5], i=[1.0, 1.5, 1.2], w=[0.5, 1.0, 0.8], comm=0.05)),
        (8, 8, Costs(comm=0.02)),
    ],
)
@pytest.mark.parametrize("at_one_f_one_b", [False, True])
def test_zb_auto_weighs_the_v_by_time_under_any_limit(p, m, costs, at_one_f_one_b):
    """``v_always`` (a pipeline's default): with no limit, or 1F1B's, the V competes by the
    objective, its extra messages counted (each chunk's ``comm``); the result is the faster
    placement and never behind a fixed schedule in either placement that fits the same memory.
    (Looped placements, interleaved-1f1b and looped-bfs, are not among zb-auto's: with stages of
    uneven cost, chunk c on rank c mod p can even out the ranks' work where neither in-line nor
    the V does.)"""
    stage_costs = costs.resolve(p)
    chunk_costs = stage_costs.chunked(2)
    limit = max(simulate(make_schedule("1f1b", p, m, costs), costs).peak_memory) if at_one_f_one_b else None
    auto = make_schedule("zb-auto", p, m, costs, memory_limit=limit, time_budget=0, v_always=True)
    in_line = make_schedule("zb-auto", p, m, costs, memory_limit=limit, time_budget=0, placements=("in-line",))
    value = simulate(auto, chunk_costs if auto.stages == 2 * p else stage_costs).span
    in_line_value = simulate(in_line, stage_costs).span
    assert value <= in_line_value + 1e-9
    assert (auto.info["placement"] == "v") == (value < in_line_value - 1e-9)
    for name in (*FIXED, "zbv"):
        chunks = p * schedule_spec(name).chunks_per_rank
        if name in ("interleaved-1f1b", "looped-bfs"):
            continue
        sc = stage_costs if chunks == p else chunk_costs
        res = simulate(make_schedule(name, chunks, m, sc, check=False), sc)
        if limit is None or max(res.peak_memory) <= limit + 1e-9:
            assert value <= res.span + 1e-9, name


def test_zb_auto_keeps_one_stage_per_rank_when_asked():
    """By default a limit below 1F1B's (4 here) brings in the V; ("in-line",) keeps the stages."""
    assert make_schedule("zb-auto", 4, 8, Costs(), memory_limit=2.5, time_budget=0).stages == 8
    auto = make_schedule("zb-auto", 4, 8, Costs(), memory_limit=2.5, time_budget=0, placements=("in-line",))
    assert auto.info["placement"] == "in-line" and auto.stages == 4
    with pytest.raises(ValueError, match="placements"):
        make_schedule("zb-auto", 4, 8, placements=("diagonal",))


def test_zb_auto_v_runs_on_the_chunks_costs_it_is_given():
    """Compiled chunks rarely halve a stage: with ``chunk_costs`` the V is solved, bounded and
    checked on those (here the first chunk holds most of the memory), and merging them back
    gives the per-stage costs (``merged`` undoes ``chunked``)."""
    p, m = 3, 6
    stage_costs = Costs(f=[1.0, 2.0, 1.5], mem_b=[1.0, 0.5, 0.8], mem_w=0.4).resolve(p)
    assert stage_costs.chunked(2).merged(2) == stage_costs
    uneven = Costs(f=1.0, mem_b=[1.2, 0.2, 0.4, 0.4, 0.9, 0.1], mem_w=0.3).resolve(2 * p)
    limit = 0.7 * max(simulate(make_schedule("1f1b", p, m, uneven.merged(2)), uneven.merged(2)).peak_memory)
    auto = make_schedule(
        "zb-auto", p, m, uneven.merged(2), memory_limit=limit, time_budget=0, placements=("v",), chunk_costs=uneven
    )
    assert auto.info["placement"] == "v" and auto.stages == 2 * p
    assert max(simulate(auto, uneven).peak_memory) <= limit + 1e-9
    assert auto.info["value"] == pytest.approx(simulate(auto, uneven).span)
