"""The options that choose where a schedule's costs come from and how closely the runtime
follows it: `costs=` solves with the given costs (and says so), bad values are refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import zbcompile
from helpers.models import build
from zbcompile.options import PipelineOptions
from zbcompile.runtime.tuning.schedule_choice import static_costs
from zbcompile.schedules import Costs, make_schedule, simulate
from zbcompile.schedules.memory_limit import parse_bytes

GIVEN = Costs(f=[1.0, 3.0], i=[1.0, 3.0], w=[1.0, 3.0], mem_b=1.0, mem_w=0.5)


def test_given_costs_solve_the_schedule_and_are_reported():
    case = build("mlp")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, costs=GIVEN, solver_time_budget=0
    )
    case.step(pipe)
    expected = make_schedule("zb-auto", 2, 4, costs=GIVEN, time_budget=0)
    static = make_schedule("zb-auto", 2, 4, costs=pipe.compiled.schedule_costs(), time_budget=0)
    assert expected.actions != static.actions  # else this test could not tell which costs were used
    assert pipe.schedule.actions == expected.actions
    assert pipe.schedule.info["cost_source"] == "given"
    assert "costs: given to pipeline(costs=...)" in pipe.explain()


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"profile": "yes"}, ValueError, "profile must be None (automatic), True or False"),
        ({"costs": {"f": 1.0}}, TypeError, "costs must be a zbcompile.schedules.Costs"),
    ],
)
def test_bad_option_values_are_refused(options, error, words):
    case = build("mlp")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, **options)


def test_options_are_taken_by_keyword_only_and_normalised():
    with pytest.raises(TypeError):
        PipelineOptions(2, 4)  # the positional form is refused
    with pytest.raises(TypeError, match="stagez"):
        zbcompile.pipeline(build("mlp").model, stagez=2)
    options = PipelineOptions(stages=2, split_points=["fc2"], timeout=5)
    assert options.microbatches == 1 and options.split_points == ("fc2",)
    assert options.timeout == timedelta(seconds=5)


def test_memory_limit_in_bytes_is_the_same_limit_in_microbatch_units():
    """"NB" bytes solve the schedule as memory_limit = N / memory_unit: the compiler's own sizes
    (a limit that binds zb-auto, above 1F1B's, so one stage per rank stays)."""
    case = build("mlp")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=2.5, solver_time_budget=0
    )
    case.step(pipe)
    unlimited = make_schedule("zb-auto", 2, 4, costs=pipe.compiled.schedule_costs(), time_budget=0)
    assert unlimited.actions != pipe.schedule.actions  # the limit binds
    unit = pipe.compiled.memory_unit()
    in_bytes = zbcompile.pipeline(
        build("mlp").model,
        stages=2,
        microbatches=4,
        loss_fn=case.loss_fn,
        memory_limit=f"{2.5 * unit}B",
        solver_time_budget=0,
    )
    case.step(in_bytes)
    assert in_bytes.schedule.actions == pipe.schedule.actions
    assert max(simulate(in_bytes.schedule, in_bytes.compiled.schedule_costs()).peak_memory) <= 2.5 + 1e-9
    tight = zbcompile.pipeline(
        build("mlp").model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=f"{unit // 4}B"
    )
    with pytest.raises(ValueError, match=r"memory_limit '\d+B' is 0.2\d* microbatch activations .* no schedule fits"):
        case.step(tight)


def test_memory_limit_strings_are_parsed():
    assert parse_bytes("12GiB") == 12 * 2**30 and parse_bytes("800MB") == 8e8 and parse_bytes("64") == 64
    case = build("mlp")
    with pytest.raises(ValueError, match="is not a byte size"):
        zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit="12 gigs")



def test_zb_auto_picks_a_v_under_a_limit_below_one_f_one_b():
    """A limit below 1F1B's peak on one stage per rank: zb-auto cuts the model in two chunks per
    rank and runs the best V schedule that fits (the limit still in the first compile's unit),
    and explain() says so. Its gradients equal eager's, and bit for bit those of another order
    (1f1b) on the same cut."""
    limit = 1.5
    case = build("gpt")
    in_line = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="1f1b")
    in_line.compile(*case.args, target=case.target, **case.kwargs)
    assert max(simulate(in_line.schedule, in_line.compiled.schedule_costs()).peak_memory) > limit

    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=limit, solver_time_budget=0
    )
    loss = case.step(pipe)
    schedule = pipe.schedule
    assert schedule.stages == 4 and schedule.ranks == 2 and schedule.info["placement"] == "v"
    assert pipe.compiled.memory_unit() == in_line.compiled.memory_unit()
    assert max(simulate(schedule, pipe.compiled.schedule_costs()).peak_memory) <= limit + 1e-9
    assert "placement: V, two chunks per rank" in pipe.explain()
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters()}

    reference = build("gpt")
    expected = reference.eager_loss()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)

    other = build("gpt")
    same_cut = zbcompile.pipeline(other.model, stages=4, microbatches=4, loss_fn=other.loss_fn, schedule="1f1b")
    assert torch.equal(other.step(same_cut), loss)
    for fqn, p in other.model.named_parameters():
        assert torch.equal(p.grad, grads[fqn]), fqn


def test_zb_auto_weighs_the_v_by_predicted_time_with_default_options():
    """No memory limit: zb-auto weighs one stage per rank against a V of the model cut in 2p
    chunks by the simulated span on the compiler's costs with the messages' time
    (`schedule_choice.static_costs`), the V's extra messages included, and runs the faster: the V for the
    GPT with 2 microbatches on 2 ranks (the fill and drain dominate), compiled in 4 chunks, with
    eager's gradients; one stage per rank for the MLP with 4, where the V's messages cost more
    than its shorter fill gains."""
    case = build("gpt")
    in_line = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, schedule="1f1b")
    in_line.compile(*case.args, target=case.target, **case.kwargs)
    expected_in_line = make_schedule(
        "zb-auto", 2, 2, static_costs(in_line.compiled), time_budget=0, placements=("in-line",)
    )

    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, solver_time_budget=0)
    loss = case.step(pipe)
    schedule = pipe.schedule
    assert schedule.info["placement"] == "v" and schedule.stages == 4 and len(pipe.compiled.programs) == 4
    assert schedule.info["in_line_value"] == pytest.approx(expected_in_line.info["value"])
    assert schedule.info["value"] == pytest.approx(simulate(schedule, static_costs(pipe.compiled)).span)
    assert schedule.info["value"] < schedule.info["in_line_value"]
    reference = build("gpt")
    expected = reference.eager_loss()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(case.model.get_parameter(fqn).grad, p.grad, rtol=1e-5, atol=1e-6, msg=fqn)

    mlp = build("mlp")
    kept = zbcompile.pipeline(mlp.model, stages=2, microbatches=4, loss_fn=mlp.loss_fn, solver_time_budget=0)
    kept.compile(*mlp.args, target=mlp.target, **mlp.kwargs)
    assert kept.schedule.info["placement"] == "in-line" and kept.schedule.stages == 2
    assert kept.schedule.info["v_value"] > kept.schedule.info["value"]
