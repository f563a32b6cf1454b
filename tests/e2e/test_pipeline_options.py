"""The options that choose where a schedule's costs come from and how closely the runtime
follows it: `costs=` solves with the given costs (and says so), bad values are refused."""

from __future__ import annotations

import pytest

import zbcompile
from helpers.models import build
from zbcompile.schedules import Costs, make_schedule, simulate
from zbcompile.schedules.memory_limit import parse_bytes

GIVEN = Costs(f=[1.0, 3.0], i=[1.0, 3.0], w=[1.0, 3.0], mem_b=1.0, mem_w=0.5)


def test_given_costs_solve_the_schedule_and_are_reported():
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, costs=GIVEN, solver_time_budget=0)
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


def test_memory_limit_in_bytes_is_the_same_limit_in_microbatch_units():
    """"NB" bytes solve the schedule as memory_limit = N / memory_unit: the compiler's own sizes."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=1.5, solver_time_budget=0)
    case.step(pipe)
    unlimited = make_schedule("zb-auto", 2, 4, costs=pipe.compiled.schedule_costs(), time_budget=0)
    assert unlimited.actions != pipe.schedule.actions  # the limit binds
    unit = pipe.compiled.memory_unit()
    in_bytes = zbcompile.pipeline(
        build("mlp").model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=f"{1.5 * unit}B", solver_time_budget=0
    )
    case.step(in_bytes)
    assert in_bytes.schedule.actions == pipe.schedule.actions
    assert max(simulate(in_bytes.schedule, in_bytes.compiled.schedule_costs()).peak_memory) <= 1.5 + 1e-9
    tight = zbcompile.pipeline(build("mlp").model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit=f"{unit // 4}B")
    with pytest.raises(ValueError, match=r"memory_limit '\d+B' is 0.2\d* microbatch activations .* no schedule fits"):
        case.step(tight)


def test_memory_limit_strings_are_parsed():
    assert parse_bytes("12GiB") == 12 * 2**30 and parse_bytes("800MB") == 8e8 and parse_bytes("64") == 64
    case = build("mlp")
    with pytest.raises(ValueError, match="is not a byte size"):
        zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, memory_limit="12 gigs")
