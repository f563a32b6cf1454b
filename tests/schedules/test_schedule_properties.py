"""Property tests: random per-stage costs, comm and memory limits."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbcompile.schedules import Costs, make_schedule, simulate, validate
from zbcompile.schedules.simulate import peak_memory

TOL = 1e-9


@st.composite
def instances(draw):
    p = draw(st.integers(1, 12))
    m = draw(st.integers(1, 4 * p))
    cost = st.floats(0.1, 5.0, allow_nan=False)
    f = draw(st.lists(cost, min_size=p, max_size=p))
    b = draw(st.lists(cost, min_size=p, max_size=p))
    w = draw(st.lists(cost, min_size=p, max_size=p))
    comm = draw(st.floats(0.0, 1.0))
    mem_b = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=p, max_size=p))
    mem_w = [mf * draw(st.sampled_from([0.0, 0.25, 0.5])) for mf in mem_b]
    factor = draw(st.sampled_from([1.0, 1.5, 2.0, 0.5, None]))
    if factor is None:
        limit = None
    else:  # per stage, never below one microbatch (the feasibility minimum)
        limit = [max(mf, factor * p * mf) for mf in mem_b]
    return p, m, Costs(f=f, i=b, w=w, comm=comm, mem_b=mem_b, mem_w=mem_w), limit


def _fits(sched, costs, limit):
    if limit is None:
        return True
    return all(pk <= lim + TOL for pk, lim in zip(peak_memory(sched, costs.resolve(sched.stages)), limit))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["span", "makespan"]))
def test_zb_auto_never_worse_than_handcrafted_and_within_memory(instance, objective):
    p, m, costs, limit = instance
    auto = make_schedule(
        "zb-auto", p, m, costs, memory_limit=limit, objective=objective, time_budget=0, placements=("in-line",)
    )
    validate(auto, costs, limit)
    res = simulate(auto, costs)
    if limit is not None:
        assert all(pk <= lim + TOL for pk, lim in zip(res.peak_memory, limit))
    value = res.objective(objective)
    for name in ("1f1b", "zb-h1"):
        hand = make_schedule(name, p, m, costs, check=False)
        if _fits(hand, costs, limit):
            assert value <= simulate(hand, costs).objective(objective) + 1e-7, name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2"]))
def test_generated_schedules_validate(instance, name):
    p, m, costs, _ = instance
    sched = make_schedule(name, p, m, costs)  # make_schedule validates, lowering included
    res = simulate(sched, costs)
    assert res.makespan >= max(res.busy) - 1e-9
    assert res.span <= res.makespan + 1e-9
    assert 0 <= res.stage_bubble_rate <= res.bubble_rate + 1e-12


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6), st.integers(1, 16), st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0.1, 3))
def test_zbv_validates_at_1f1b_memory(ranks, m, f, b, w):
    costs = Costs(f=f, i=b, w=w, comm=0.05)
    sched = make_schedule("zbv", 2 * ranks, m, costs)
    assert max(simulate(sched, costs).peak_memory) <= ranks * 2 + TOL
