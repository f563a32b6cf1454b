"""zb-auto's exact improvement (CP-SAT, deterministic mode, small budgets)."""

import pytest

from zbcompile.schedules import Costs, make_schedule, simulate, validate

PROFILE = Costs(f=18.522, i=18.086, w=9.337, comm=0.601)


@pytest.mark.parametrize("objective", ["span", "makespan"])
def test_solver_proves_optimum_on_a_small_instance(objective):
    sched = make_schedule(
        "zb-auto",
        3,
        4,
        PROFILE,
        memory_limit=3.0,
        objective=objective,
        time_budget=20,
        placements=("in-line",),
        deterministic=True,
    )
    info = sched.info
    value = simulate(sched, PROFILE).objective(objective)
    assert info["status"] == "OPTIMAL"
    assert value == pytest.approx(info["value"])
    assert value <= info["heuristic_value"] + 1e-9
    assert info["lower_bound"] <= value + 1e-9
    assert value - info["lower_bound"] < 1e-3 * value  # tight up to the integer rounding of costs


def test_solver_result_never_worse_and_valid():
    costs = Costs(f=[1.0, 1.4, 0.8, 1.1], i=[0.0, 1.3, 1.0, 1.6], w=[0.9, 0.5, 0.7, 0.6], comm=0.2)
    limit = [2.0, 3.0, 2.0, 2.0]
    sched = make_schedule(
        "zb-auto", 4, 8, costs, memory_limit=limit, time_budget=4, placements=("in-line",), deterministic=True
    )
    validate(sched, costs, limit)
    res = simulate(sched, costs)
    assert res.span <= sched.info["heuristic_value"] + 1e-9
    assert sched.info["lower_bound"] <= res.span + 1e-9
    assert all(p <= l + 1e-9 for p, l in zip(res.peak_memory, limit))


def test_zero_budget_returns_the_heuristic_with_the_analytic_bound():
    sched = make_schedule("zb-auto", 4, 8, PROFILE, memory_limit=4.0, time_budget=0)
    assert sched.info["status"] == "heuristic"
    assert sched.info["lower_bound"] == pytest.approx(8 * (18.522 + 18.086 + 9.337))
