"""The cut decision (`zbcompile/schedules/cut_choice.py`) on fixed per-position costs: which cut it
chooses given each rank's times and memory, deterministic (no timing, solver work counted)."""

import math
from dataclasses import replace

import pytest

from zbcompile.schedules import Costs, make_schedule, simulate
from zbcompile.schedules.cut_choice import CutSettings, CutUnits, choose_cut, predict
from zbcompile.schedules.cut_search import Cut, bottleneck_cut, holds_parameters, neighbours
from zbcompile.schedules.cut_units import segments_of, v_rank

N = 40  # positions: a model of 40 equal blocks


def units(speeds=(1.0, 1.0), extra=None, param_bytes=None, crossing=10.0):
    """Per rank its speed factor (time multiplier); `extra`: {position: seconds} added to F, I, W
    (an op slower than its FLOPs say); `param_bytes`: per position the bytes of the parameter it reads."""
    base = [1.0] * N
    for position, seconds in (extra or {}).items():
        base[position] += seconds
    times = tuple(
        (tuple(b * s for b in base), tuple(b * s for b in base), tuple(0.7 * b * s for b in base)) for s in speeds
    )
    params = tuple(((param_bytes or [100.0] * N)[p], (p,)) for p in range(N))
    return CutUnits(
        times=times, mem_b=(1.0,) * N, mem_w=(0.5,) * N, crossing=(crossing,) * (N + 1),
        allowed=tuple(range(1, N)), params=params,
    )


def stage_work(cut, u, rank):
    bounds = cut.bounds(N)
    return sum(
        sum(u.times[rank][k][a:b])
        for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
        if cut.rank_of(s) == rank
        for k in range(3)
    )


def test_a_slower_rank_gets_less_work_and_the_gain_is_predicted():
    u = units(speeds=(1.0, 1.5))
    decision = choose_cut(u, Cut("in-line", (20,)), CutSettings(microbatches=8))
    assert decision.changes
    assert decision.chosen.cut.positions[0] > 20  # rank 0 (the faster) takes more positions
    assert decision.gain > 1.15
    work = [stage_work(decision.chosen.cut, u, r) for r in range(2)]
    assert max(work) / min(work) < 1.1  # balanced on the ranks' own speeds
    # the prediction is the simulator's span of zb-auto under the chosen cut's summed costs
    costs = decision.chosen.costs
    schedule = make_schedule("zb-auto", 2, 8, costs, placements=("in-line",), time_budget=0.2, deterministic=True)
    assert simulate(schedule, costs).span == pytest.approx(decision.chosen.value, rel=0.02)


def test_equal_ranks_keep_the_balanced_cut():
    decision = choose_cut(units(), Cut("in-line", (20,)), CutSettings(microbatches=8))
    assert not decision.changes and decision.chosen.cut == Cut("in-line", (20,))
    assert "predicted best" in decision.reason or "threshold" in decision.reason


def test_a_gain_below_the_threshold_keeps_the_cut_in_use():
    u = units(speeds=(1.0, 1.02))
    decision = choose_cut(u, Cut("in-line", (20,)), CutSettings(microbatches=8), threshold=0.03)
    assert not decision.changes
    forced = choose_cut(u, Cut("in-line", (20,)), CutSettings(microbatches=8), threshold=0.0)
    assert forced.gain >= decision.gain


def test_a_first_stage_slower_than_its_flops_is_recut_or_put_in_a_v():
    """Position 0 (an embedding, say) takes 6 blocks' time where the static cut counted one: the
    measured decision moves the cut (or chooses the V), predicting a gain."""
    u = units(extra={0: 6.0})
    decision = choose_cut(u, Cut("in-line", (20,)), CutSettings(microbatches=8, placements=("in-line", "v")))
    assert decision.changes and decision.gain > 1.05
    chosen = decision.chosen.cut
    assert chosen.placement == "v" or chosen.positions[0] < 20


def test_the_v_is_chosen_where_fill_and_drain_dominate_and_not_where_messages_are_dear():
    cheap = choose_cut(units(speeds=(1.0,) * 4), Cut("in-line", (10, 20, 30)), CutSettings(microbatches=4,
                       placements=("in-line", "v")))
    assert cheap.chosen.cut.placement == "v" and cheap.chosen.cut.stages == 8
    dear = choose_cut(units(speeds=(1.0,) * 4, crossing=1000.0), Cut("in-line", (10, 20, 30)),
                      CutSettings(microbatches=4, placements=("in-line", "v"), comm_per_byte=0.01))
    assert dear.chosen.cut.placement == "in-line"


def test_the_runtimes_own_time_per_action_counts_against_the_v_which_runs_twice_the_actions():
    """Each action's host time is added to F, I and W of every stage or chunk: where it is large
    against the actions (short actions), the V's halved fill and drain no longer pay for its
    doubled actions."""
    settings = CutSettings(microbatches=4, placements=("in-line", "v"))
    in_line = Cut("in-line", (10, 20, 30))
    assert choose_cut(units(speeds=(1.0,) * 4), in_line, settings).chosen.cut.placement == "v"
    costly = choose_cut(units(speeds=(1.0,) * 4), in_line, replace(settings, action_host=8.0))
    assert costly.chosen.cut.placement == "in-line"
    segments = segments_of(units())
    plain = predict(units(), Cut("in-line", (20,)), CutSettings(microbatches=4), segments).costs
    hosted = predict(units(), Cut("in-line", (20,)), CutSettings(microbatches=4, action_host=0.5), segments).costs
    assert hosted.f == [f + 0.5 for f in plain.f] and hosted.w == [w + 0.5 for w in plain.w]


def test_memory_moves_the_cut_where_the_balanced_one_does_not_fit():
    """The second half's parameters are four times heavier: the balanced cut puts 80% of the
    state on rank 1, over its limit; the chosen cut fits both ranks, at some cost in time."""
    heavy = [100.0] * 20 + [400.0] * 20
    u = units(param_bytes=heavy)
    settings = CutSettings(microbatches=8, state_per_byte=1.0, limits=(6000.0, 6000.0))
    balanced = Cut("in-line", (20,))
    segments = segments_of(u)
    assert predict(u, balanced, settings, segments).value == math.inf  # rank 1: 8000 bytes of state
    decision = choose_cut(u, balanced, settings)
    assert decision.changes and decision.chosen.value < math.inf
    assert all(s <= 6000.0 for s in decision.chosen.state_bytes)
    assert decision.chosen.cut.positions[0] > 20
    assert "does not fit" in decision.reason


def test_a_v_chunk_sits_on_its_rank_down_and_back_up():
    assert [v_rank(c, 3) for c in range(6)] == [0, 1, 2, 2, 1, 0]
    cut = Cut("v", (5, 10, 15))
    assert cut.ranks() == 2 and [cut.rank_of(s) for s in range(4)] == [0, 1, 1, 0]


def test_bottleneck_cut_balances_each_rank_on_its_own_speed():
    u = units(speeds=(1.0, 2.0, 1.0))
    positions = bottleneck_cut(segments_of(u), 3, "in-line")
    cut = Cut("in-line", positions)
    work = [stage_work(cut, u, r) for r in range(3)]
    assert max(work) / min(work) < 1.15
    sizes = [b - a for a, b in zip(cut.bounds(N), cut.bounds(N)[1:])]
    assert sizes[1] < sizes[0] and sizes[1] < sizes[2]


def test_bad_units_and_settings_are_refused():
    with pytest.raises(ValueError, match="crossing"):
        CutUnits(times=(((1.0,), (1.0,), (1.0,)),), mem_b=(1.0,), mem_w=(1.0,), crossing=(0.0,), allowed=())
    with pytest.raises(ValueError, match="placements"):
        CutSettings(microbatches=4, placements=("looped",))
    with pytest.raises(ValueError, match="placement"):
        Cut("diagonal", (1,))


def test_predicted_costs_sum_the_positions_of_each_stage():
    u = units(speeds=(1.0, 1.5))
    prediction = predict(u, Cut("in-line", (10,)), CutSettings(microbatches=4), segments_of(u), 0.0)
    assert isinstance(prediction.costs, Costs)
    assert prediction.costs.f == [10.0, 30 * 1.5] and prediction.costs.w == pytest.approx([7.0, 0.7 * 30 * 1.5])
    assert prediction.state_bytes == (0.0, 0.0)  # no state counted without state_per_byte


def test_every_stage_keeps_a_parameter_however_slow_its_rank():
    """Positions between the ones that read parameters (a block's activation, a residual add)
    are not a stage: a rank left without parameters has nothing to train (and torch's optimizers
    refuse its empty list), so the slow rank still gets a parameter, in-line and in a V."""
    u = units(speeds=(1.0, 50.0, 1.0))
    u = replace(u, params=tuple((100.0, (p,)) for p in range(0, N, 6)))  # 7 parameters, at 0, 6, ..., 36
    segments = segments_of(u)
    for placement, backward in [("in-line", False), ("in-line", True), ("v", False), ("v", True)]:
        cut = Cut(placement, bottleneck_cut(segments, 3, placement, backward=backward))
        assert holds_parameters(cut, segments), (placement, backward, cut)
        assert all(holds_parameters(c, segments) for c in neighbours(cut, segments))
    decision = choose_cut(u, Cut("in-line", (13, 26)), CutSettings(microbatches=8, placements=("in-line",)))
    assert decision.changes and holds_parameters(decision.chosen.cut, segments)
    bounds = decision.chosen.cut.bounds(N)
    assert bounds[2] - bounds[1] < 13  # the slow rank still gets less work
    # more stages than parameters: no cut qualifies (the cut in use stays)
    few = replace(u, params=((100.0, (0,)), (100.0, (39,))))
    assert bottleneck_cut(segments_of(few), 3, "in-line") is None
