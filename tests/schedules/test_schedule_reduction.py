"""Gradient reduction over data-parallel replicas in the simulator and in zb-auto: each stage's
reduction starts after its last W, on the rank's link (not its compute), and the step ends when
the last reduction ends; with no reduction (one replica) nothing changes."""

import pytest

from zbcompile.schedules import Costs, make_schedule, simulate
from zbcompile.schedules.costs import resolve_costs, with_reduction

# A case (found by comparing zb-auto's choices over small random costs) where stage 0's large
# reduction makes zb-auto trade a later end elsewhere for an earlier last W on stage 0.
F, I, W = [1, 2, 3], [1, 1, 1], [1, 3, 1]
REDUCE = [8, 0, 0]


def _last_w_end(schedule, result, stage: int) -> float:
    return max(result.end[a] for row in schedule.actions for a in row if a.kind in "WB" and a.stage == stage)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2"])
def test_a_reduction_adds_its_tail_after_the_stages_last_gradient_action(name):
    """Every stage's reduction ends `reduce[s]` after its last W or B (one stage per rank, so
    its link is free then); each rank's span and the makespan reach to that end."""
    reduce = [2.5, 0.0, 4.0, 1.0]
    plain, reduced = Costs(f=1.0, i=1.2, w=0.8, comm=0.3), Costs(f=1.0, i=1.2, w=0.8, comm=0.3, reduce=reduce)
    schedule = make_schedule(name, 4, 6, plain)
    before, after = simulate(schedule, plain), simulate(schedule, reduced)
    assert before.reduction_end is None
    assert after.end == before.end and after.busy == before.busy  # the compute stream is unchanged
    for stage in range(4):
        assert after.reduction_end[stage] == _last_w_end(schedule, before, stage) + reduce[stage]
        first = min(before.start[a] for a in schedule.actions[stage] if a.is_compute)
        assert after.rank_span[stage] == max(before.rank_span[stage], after.reduction_end[stage] - first)
    starts = min(before.start.values())
    assert after.makespan == max(before.makespan, max(after.reduction_end.values()) - starts)
    assert after.makespan > before.makespan  # under these schedules stage 0's B or W ends the step


def test_reductions_on_one_rank_share_its_link_in_the_order_their_w_end():
    """Under a V a rank holds two stages: the second reduction waits for the first."""
    costs = Costs(f=1.0, i=1.0, w=1.0, reduce=[5.0, 0.0, 0.0, 5.0])  # stages 0 and 3 on rank 0
    schedule = make_schedule("zbv", 4, 4, costs)
    assert schedule.stage_to_rank == (0, 1, 1, 0)
    result = simulate(schedule, costs)
    first, second = sorted((_last_w_end(schedule, result, s), s) for s in (0, 3))
    assert result.reduction_end[first[1]] == first[0] + 5.0
    assert result.reduction_end[second[1]] == max(second[0], result.reduction_end[first[1]]) + 5.0


def test_counting_the_reduction_moves_zb_autos_last_w_earlier():
    """Without the reduction zb-auto's choice is the faster one; counting it, zb-auto chooses a
    schedule whose stage-0 W finish earlier, faster once the reduction's tail is counted."""
    plain, reduced = Costs(f=F, i=I, w=W), Costs(f=F, i=I, w=W, reduce=REDUCE)
    unaware = make_schedule("zb-auto", 3, 4, plain, time_budget=0.5, deterministic=True, placements=("in-line",))
    aware = make_schedule("zb-auto", 3, 4, reduced, time_budget=0.5, deterministic=True, placements=("in-line",))
    assert aware.actions != unaware.actions
    assert simulate(unaware, plain).span < simulate(aware, plain).span  # the choice without the tail
    with_tail = simulate(aware, reduced)
    assert with_tail.span < simulate(unaware, reduced).span
    assert _last_w_end(aware, with_tail, 0) < _last_w_end(unaware, simulate(unaware, reduced), 0)
    assert aware.info["value"] == with_tail.span  # zb-auto's value is the simulated step with its tail
    assert with_tail.span == with_tail.reduction_end[0] - min(with_tail.start.values())


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-auto", "zbv"])
def test_without_replicas_nothing_changes(name):
    """One replica: `with_reduction` leaves the costs as they are (the same object), so every
    schedule and its simulation are the same, bit for bit."""
    costs = Costs(f=[1.0, 1.5, 1.2, 0.9], i=1.1, w=0.6, comm=0.2)
    assert with_reduction(costs, [0.0] * 4) is costs
    stages = 8 if name == "zbv" else 4
    chunked = resolve_costs(costs, 4).chunked(2) if name == "zbv" else costs
    zero = resolve_costs(Costs(f=[1.0, 1.5, 1.2, 0.9], i=1.1, w=0.6, comm=0.2, reduce=0.0), 4)
    zero = zero.chunked(2) if name == "zbv" else zero
    kwargs = dict(time_budget=0.3, deterministic=True, placements=("in-line",)) if name == "zb-auto" else {}
    one, other = make_schedule(name, stages, 8, chunked, **kwargs), make_schedule(name, stages, 8, zero, **kwargs)
    assert one.actions == other.actions
    a, b = simulate(one, chunked), simulate(other, zero)
    assert (a.makespan, a.span, a.rank_span, a.peak_memory) == (b.makespan, b.span, b.rank_span, b.peak_memory)


def test_with_reduction_scales_the_message_time_and_keeps_given_times():
    costs = Costs(f=1.0, i=1.0, w=1.0, comm=0.5)
    assert with_reduction(costs, [2.0, 0.0]).reduce == (1.0, 0.0)
    assert with_reduction(Costs(comm=0.5, reduce=3.0), [2.0, 2.0]).reduce == 3.0
    assert with_reduction(Costs(comm=0.0), [2.0, 2.0]).reduce == 0.0
    with pytest.raises(ValueError, match="reduce"):
        Costs(reduce=[1.0, -1.0]).resolve(2)
