"""A backward fused again where splitting it does not pay (`schedules/fusion.py`): the fused B's
own time (`Costs.b`) in the simulator, the fusion pass (never slower, within memory, runnable,
untouched where B saves nothing), and in a pipeline the gradients of a schedule fused in part
bitwise those of the split one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zbcompile
from helpers.models import build
from zbcompile.runtime.step.rank_program import defer_weights
from zbcompile.runtime.tuning import recut
from zbcompile.schedules import Action, Costs, make_schedule, simulate
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.fusion import fused_for, fused_where_it_pays, gradients_in_order
from zbcompile.schedules.validate import validate

SPLIT = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0], comm=0.1)


def _kinds(schedule, kind: str) -> set[tuple[int, int]]:
    return {(a.stage, a.microbatch) for row in schedule.actions for a in row if a.kind == kind}


def test_a_fused_backward_takes_its_own_time_where_given_and_i_plus_w_elsewhere():
    resolved = resolve_costs(dataclasses.replace(SPLIT, b=[1.5, 2.0]), 2)
    assert resolved.duration(0, "B") == 1.5 and resolved.duration(1, "B") == 2.0
    assert resolve_costs(SPLIT, 2).duration(0, "B") == 2.0
    assert resolved.chunked(2).b == (0.75, 0.75, 1.0, 1.0) and resolved.chunked(2).merged(2).b == resolved.b
    one_f_one_b = make_schedule("1f1b", 2, 4, SPLIT)
    assert simulate(one_f_one_b, resolved).busy == (4 * (1.0 + 1.5), 4 * (1.0 + 2.0))


def test_fused_for_fuses_the_chosen_microbatches_on_every_stage():
    schedule = make_schedule("zb-h1", 2, 6, SPLIT)
    fused = fused_for(schedule, [1, 3, 5])
    validate(fused)
    assert _kinds(fused, "B") == {(s, k) for s in range(2) for k in (1, 3, 5)}
    assert _kinds(fused, "W") == _kinds(fused, "I") == {(s, k) for s in range(2) for k in (0, 2, 4)}


@pytest.mark.parametrize("name, stages, ranks", [("zb-h1", 4, 4), ("zb-h2", 2, 2), ("zbv", 4, 2)])
def test_where_b_saves_time_the_pass_fuses_without_slowing_the_schedule_or_raising_its_memory(name, stages, ranks):
    split = Costs(f=1.0, i=1.0, w=1.0, comm=0.1)
    schedule = make_schedule(name, stages, 8, split, ranks=ranks)
    cheaper = dataclasses.replace(split, b=1.7)
    fused = fused_where_it_pays(schedule, cheaper)
    validate(fused)
    assert fused.info["fused"] > 0 and fused.info["fused_of"] == stages * 8
    assert simulate(fused, cheaper).span < simulate(schedule, cheaper).span
    peak = max(simulate(schedule, cheaper).peak_memory)
    assert max(simulate(fused, cheaper).peak_memory) <= peak
    assert _kinds(fused, "B") | _kinds(fused, "I") == _kinds(schedule, "I")  # each backward once, split or fused
    assert not _kinds(fused, "B") & _kinds(fused, "W")


def test_where_b_saves_nothing_or_is_not_measured_the_schedule_is_unchanged():
    schedule = make_schedule("zb-h1", 2, 8, SPLIT)
    assert fused_where_it_pays(schedule, SPLIT) is schedule
    assert fused_where_it_pays(schedule, dataclasses.replace(SPLIT, b=[2.0, 2.5])) is schedule


def test_a_memory_limit_keeps_the_fusions_that_would_pass_it_out():
    """mem_w above mem_b: a fused B peaks at its I part's level, so fusing can raise a rank's
    peak; a limit at the split schedule's own peak keeps every rank within it."""
    costs = dataclasses.replace(SPLIT, b=[1.0, 1.0], mem_b=1.0, mem_w=1.5)
    schedule = make_schedule("zb-h1", 2, 8, costs)
    limit = max(simulate(schedule, costs).peak_memory)
    fused = fused_where_it_pays(schedule, costs, limit)
    assert max(simulate(fused, costs).peak_memory) <= limit + 1e-9
    per_rank = list(simulate(schedule, costs).peak_memory)  # a limit per rank: each rank's own peak
    fused = fused_where_it_pays(schedule, costs, per_rank)
    assert all(p <= q + 1e-9 for p, q in zip(simulate(fused, costs).peak_memory, per_rank))


def test_a_pipeline_fused_in_part_gives_the_split_schedules_gradients_bitwise():
    case = build("gpt")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="zb-h1")
    pipe.compile(*case.args, target=case.target)
    split = pipe.schedule

    def grads(schedule) -> dict[str, torch.Tensor]:
        pipe.runner.reschedule(schedule)
        pipe.zero_grad()
        case.step(pipe)
        return {n: p.grad.clone() for n, p in case.model.named_parameters()}

    reference = grads(split)
    in_part = fused_where_it_pays(split, Costs(f=1.0, i=1.0, w=1.0, comm=0.1, b=1.7))
    assert 0 < in_part.info["fused"] < in_part.info["fused_of"]
    for fused in (in_part, fused_for(split, range(4))):
        assert all(gradients_in_order(row) for row in fused.actions)
        for name, grad in grads(fused).items():
            assert torch.equal(grad, reference[name]), name


def test_a_stages_gradients_stay_in_microbatch_order_where_a_w_is_deferred_past_a_send():
    """`defer_weights` moves a W past the next send (after a split I of a later microbatch),
    but never past a fused B of a later microbatch of the same stage (the sums would change bits)."""
    memory = resolve_costs(Costs(), 2)

    def deferred(second_backward: str) -> tuple:
        row = [Action(1, "F", 0), Action(1, "F", 1), Action(1, "I", 0), Action(1, "SEND_B", 0), Action(1, "W", 0)]
        row += [Action(1, second_backward, 1), Action(1, "SEND_B", 1)]
        row += [Action(1, "W", 1)] if second_backward == "I" else []
        return defer_weights(tuple(row), memory)[1]

    assert deferred("I") == ("1W0",)  # past the send of microbatch 1's gradients
    assert deferred("B") == ()  # it would follow 1B1


def test_the_cut_decisions_costs_carry_b_measured_at_the_cut_measured_and_scaled_elsewhere():
    """At the cut the calibration ran, each stage's B is its measured time; at any other cut,
    its I + W times the measured B / (I + W); nothing measured, the costs are unchanged."""
    measured_cut = Costs(f=[1.0, 1.0], i=[2.0, 2.0], w=[1.0, 1.0])
    fused = {0: 2.4, 1: 2.7}
    share = recut._fused_share(fused, measured_cut)
    assert share == pytest.approx(5.1 / 6.0)
    assert recut.with_fused_backward(measured_cut, fused, share).b == [2.4, 2.7]
    elsewhere = recut.with_fused_backward(Costs(f=[1.0] * 4, i=[1.0] * 4, w=[0.5] * 4), {}, share)
    assert elsewhere.b == pytest.approx([1.5 * share] * 4)
    assert recut.with_fused_backward(measured_cut, {}, None) is measured_cut
