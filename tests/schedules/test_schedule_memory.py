"""Memory model with M_W > M_B: an input-gradient pass I that *raises* memory.

Model: F adds mem_b (M_B), I adds mem_w - mem_b (positive here), W frees mem_w (M_W), a fused B
is I then W in one action (it peaks max(0, mem_w - mem_b) above the level before it, then ends
mem_b lower). Notation below: e = max(0, M_W - M_B), p stages, m microbatches, stage s from 0.
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbcompile.schedules import Costs, ScheduleError, lower, make_schedule, simulate, validate
from zbcompile.schedules.fastsim import Evaluator
from zbcompile.schedules.greedy import POLICIES, list_schedule
from zbcompile.schedules.handcrafted import v_placement
from zbcompile.schedules.heuristic import minimum_memory, one_f_one_b_peak, sequential
from zbcompile.schedules.row_edits import make_room
from zbcompile.schedules.search import analytic_parameters, handcrafted_rows, pattern_rows
from zbcompile.schedules.simulate import peak_memory

TOL = 1e-9


def replay_peaks(sched, costs):
    """Brute force: per rank, the memory events at the simulated times, summed in time order.
    F, I and W change memory when they end; a fused B adds mem_w - mem_b when its I part ends
    (start + b) and frees mem_w when it ends."""
    sc = costs.resolve(sched.stages)
    res = simulate(sched, costs)
    peaks = []
    for row in sched.actions:
        events = []
        for a in row:
            if not a.is_compute:
                continue
            s, t0, t1 = a.stage, res.start[a], res.end[a]
            mf, mw = sc.mem_b[s], sc.mem_w[s]
            if a.kind == "F":
                events.append((t1, mf))
            elif a.kind == "I":
                events.append((t1, mw - mf))
            elif a.kind == "W":
                events.append((t1, -mw))
            else:
                events += [(t0 + sc.i[s], mw - mf), (t1, -mw)]
        level = peak = 0.0
        for _, delta in sorted(events, key=lambda e: e[0]):
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks


@st.composite
def instances(draw, max_p=8):
    """Random per-stage costs with M_W drawn in (0, 2 M_B] and a limit never below the feasibility
    minimum max(M_B, M_W) per stage."""
    p = draw(st.integers(1, max_p))
    m = draw(st.integers(1, 3 * p))
    cost = st.floats(0.1, 5.0, allow_nan=False)
    f = draw(st.lists(cost, min_size=p, max_size=p))
    b = draw(st.lists(cost, min_size=p, max_size=p))
    w = draw(st.lists(cost, min_size=p, max_size=p))
    comm = draw(st.floats(0.0, 1.0))
    mem_b = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=p, max_size=p))
    mem_w = [mf * draw(st.floats(0.01, 2.0)) for mf in mem_b]
    factor = draw(st.sampled_from([0.0, 0.3, 1.0, 1.5, 2.0, None]))
    if factor is None:
        limit = None
    else:
        limit = [max(mf, mw) + factor * (p - 1) * mf for mf, mw in zip(mem_b, mem_w)]
    return p, m, Costs(f=f, i=b, w=w, comm=comm, mem_b=mem_b, mem_w=mem_w), limit


def test_costs_accept_mem_w_above_mem_b():
    sc = Costs(mem_b=2.0, mem_w=2.5).resolve(3)
    assert sc.memory_delta(0, "I") == pytest.approx(0.5)  # I adds mem_w - mem_b
    assert sc.memory_delta(0, "W") == -2.5
    assert sc.memory_delta(0, "B") == -2.0
    assert sc.memory_rise(0, "B") == pytest.approx(0.5)
    assert Costs(mem_b=1.0, mem_w=0.5).resolve(1).memory_rise(0, "B") == 0.0
    assert minimum_memory((0, 1, 2), sc) == (2.5, 2.5, 2.5)  # one microbatch: max(M_B, M_W)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"]))
def test_generated_schedules_validate_and_peak_matches_replay(instance, name):
    p, m, costs, _ = instance
    if name == "interleaved-1f1b":
        if p % 2:
            p, costs = p + 1, Costs(f=1.0, i=2.0, w=0.5, comm=0.1, mem_b=1.0, mem_w=1.6)
        m = max(p // 2, m - m % (p // 2))
    sched = make_schedule(name, p, m, costs)  # validated, lowering included
    peaks = simulate(sched, costs).peak_memory
    assert list(peaks) == pytest.approx(replay_peaks(sched, costs))
    assert peak_memory(lower(sched, costs), costs.resolve(p)) == pytest.approx(peaks)  # messages hold no memory


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["span", "makespan"]))
def test_zb_auto_within_every_feasible_limit(instance, objective):
    p, m, costs, limit = instance
    auto = make_schedule(
        "zb-auto", p, m, costs, memory_limit=limit, objective=objective, time_budget=0, placements=("in-line",)
    )
    validate(auto, costs, limit)
    res = simulate(auto, costs)
    assert list(res.peak_memory) == pytest.approx(replay_peaks(auto, costs))
    if limit is not None:
        assert all(pk <= lim + TOL for pk, lim in zip(res.peak_memory, limit))
    for name in ("1f1b", "zb-h1"):  # never worse than a handcrafted schedule that fits
        hand = make_schedule(name, p, m, costs, check=False)
        if limit is None or all(pk <= lim + TOL for pk, lim in zip(simulate(hand, costs).peak_memory, limit)):
            assert res.objective(objective) <= simulate(hand, costs).objective(objective) + 1e-7, name


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_p=10), st.sampled_from(POLICIES))
def test_list_scheduler_never_stuck_at_the_minimum(instance, policy):
    """At limit = max(M_B, M_W) per stage (one microbatch in flight) or above, every policy of the
    list scheduler finishes: an I that does not fit always finds a pending W (greedy.py)."""
    p, m, costs, limit = instance
    sc = costs.resolve(p)
    limit = limit or [max(a, b) for a, b in zip(sc.mem_b, sc.mem_w)]
    sched = list_schedule("zb-auto", p, m, tuple(range(p)), sc, limit, policy)
    validate(sched, sc, limit, check_lowering=False)
    ev = Evaluator(p, m, tuple(range(p)), sc)
    warm, defer = analytic_parameters(p, sc)
    rows = pattern_rows(ev, limit, warm, defer)  # the search family never gets stuck either
    assert rows is not None and all(ev.peak(r) <= l + TOL for r, l in zip(rows, limit))


def test_below_the_minimum_is_rejected_with_the_reason():
    costs = Costs(mem_b=1.0, mem_w=1.5)
    with pytest.raises(ValueError, match=r"below one microbatch's peak \[1.5\].*mem_w"):
        make_schedule("zb-auto", 4, 8, costs, memory_limit=[4.0, 4.0, 4.0, 1.4], time_budget=0, placements=("in-line",))
    make_schedule(
        "zb-auto", 4, 8, costs, memory_limit=1.5, time_budget=0, placements=("in-line",)
    )  # exactly the minimum fits


@pytest.mark.parametrize("p,m", [(4, 4), (4, 12), (6, 3), (8, 24)])
def test_closed_form_peaks_at_mem_w_one_and_a_quarter_mem_b(p, m):
    """Uniform costs, M_B = 1, M_W = 1.25, e = 0.25; peaks on stage s:

    - 1F1B (fused B): min(p-s, m) M_B + e. k = min(p-s, m) microbatches are in flight when the
      first B runs, and a B's I part adds e only until its W part frees M_W: 1F1B never pays the
      I increase for more than one microbatch at a time. Rank maximum (m >= p): (p-1) M_B + M_W.
    - 1F1B with B split into I then W: the same.
    - GPipe: m M_B + e.
    - ZB-H1 (m >= p): (p-s) M_B + s M_W + e = (p-s-1) M_B + (s+1) M_W. The s held-back W leave
      s microbatches at M_W each; the steady (F, I, W) round adds M_B then e before W frees M_W.
      Rank maximum p max(M_B, M_W) (stage p-1 when M_W > M_B, stage 0 otherwise).
    - ZB-H2: w M_B + h M_W + e with w = min(2(p-1-s)+1, m) warm-up F and h = min(2s, m-w)
      held-back W: the held-back rounds (I, F) add M_W each, the first drain I adds e. Rank
      maximum (m >= 2p-1): (2p-1) max(M_B, M_W).
    """
    mf, mw = 1.0, 1.25
    e = max(0.0, mw - mf)
    costs = Costs(f=1.0, i=1.0, w=1.0, comm=0.0, mem_b=mf, mem_w=mw)
    sc = costs.resolve(p)

    def peaks(name):
        sched = make_schedule(name, p, m, costs)
        got = simulate(sched, costs).peak_memory
        assert list(got) == pytest.approx(replay_peaks(sched, costs))
        return got

    assert peaks("1f1b") == pytest.approx([min(p - s, m) * mf + e for s in range(p)])
    ev = Evaluator(p, m, tuple(range(p)), sc)
    assert [ev.peak(r) for r in handcrafted_rows(ev, "1f1b")] == pytest.approx(
        [min(p - s, m) * mf + e for s in range(p)]
    )
    assert peaks("gpipe") == pytest.approx([m * mf + e] * p)
    h2 = []
    for s in range(p):
        w0 = min(2 * (p - 1 - s) + 1, m)
        h2.append(w0 * mf + min(2 * s, m - w0) * mw + e)
    assert peaks("zb-h2") == pytest.approx(h2)
    if m >= 2 * p - 1:
        assert max(h2) == pytest.approx((2 * p - 1) * max(mf, mw))
    if m >= p:
        h1 = peaks("zb-h1")
        assert h1 == pytest.approx([(p - s) * mf + s * mw + e for s in range(p)])
        assert max(h1) == pytest.approx(p * max(mf, mw))
        assert max(peaks("1f1b")) == pytest.approx(one_f_one_b_peak(mf, mw, p)) == (p - 1) * mf + max(mf, mw)


def test_zb_auto_under_1f1b_memory_when_i_raises_memory():
    """At 1F1B's memory ((p-1) M_B + M_W per stage) ZB-H1 no longer fits (its last stage needs
    p M_W); zb-auto still finds a schedule within the limit and at least as good as 1F1B."""
    p, m = 4, 12
    costs = Costs(f=1.0, i=1.0, w=1.0, comm=0.05, mem_b=1.0, mem_w=1.25)
    limit = one_f_one_b_peak(1.0, 1.25, p)
    h1 = make_schedule("zb-h1", p, m, costs)
    assert max(simulate(h1, costs).peak_memory) > limit
    auto = make_schedule(
        "zb-auto", p, m, costs, memory_limit=limit, time_budget=0.5, placements=("in-line",), deterministic=True
    )
    res = simulate(auto, costs)
    assert max(res.peak_memory) <= limit + TOL
    assert res.span <= simulate(make_schedule("1f1b", p, m, costs), costs).span + 1e-9


def test_cpsat_respects_the_increase_of_i():
    """The solver's cumulative: M_B from F to W plus M_W - M_B from I's end to W's end."""
    from zbcompile.schedules.solver import improve

    p, m = 3, 5
    costs = Costs(f=1.0, i=1.0, w=1.0, comm=0.0, mem_b=1.0, mem_w=2.0)
    sc = costs.resolve(p)
    limit = [2.0, 3.0, 3.0]
    start = list_schedule("zb-auto", p, m, tuple(range(p)), sc, limit, POLICIES[0])
    result = improve(start, sc, limit, "span", 5.0, deterministic=True)
    assert result.info["status"] in ("OPTIMAL", "FEASIBLE")
    validate(result.schedule, sc, limit)
    assert all(pk <= lim + TOL for pk, lim in zip(peak_memory(result.schedule, sc), limit))


def test_make_room_moves_w_earlier_only_where_needed():
    p, m = 4, 8
    sc = Costs(mem_b=1.0, mem_w=1.5).resolve(p)
    ev = Evaluator(p, m, tuple(range(p)), sc)
    rows = handcrafted_rows(ev, "zb-h1")
    assert make_room(ev, rows, [math.inf] * p) == rows
    limit = [one_f_one_b_peak(1.0, 1.5, p)] * p
    moved = make_room(ev, rows, limit)
    assert all(ev.peak(r) <= l + TOL for r, l in zip(moved, limit))
    validate(ev.schedule("x", moved), sc, limit)
    assert moved[0] == rows[0]  # stage 0 holds back no W
    assert make_room(ev, rows, [1.4] * p) is None  # below max(M_B, M_W)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.integers(1, 14), st.floats(0.05, 2.0), st.floats(0.1, 3), st.floats(0.1, 3))
def test_zbv_fits_1f1b_memory_when_i_raises_memory(ranks, m, ratio, f, w):
    """Default zbv limit: 1F1B's peak for a whole rank, p M_B + max(0, M_W - M_B) with M_B, M_W
    summed over the rank's two chunks. The handcrafted ZB-V's deferred W exceed it when M_W > M_B;
    they are moved earlier (or the list scheduler, or one microbatch at a time, is used)."""
    costs = Costs(f=f, i=1.0, w=w, comm=0.05, mem_b=0.5, mem_w=0.5 * ratio)
    sched = make_schedule("zbv", 2 * ranks, m, costs)
    res = simulate(sched, costs)
    assert max(res.peak_memory) <= one_f_one_b_peak(1.0, ratio, ranks) + TOL
    assert list(res.peak_memory) == pytest.approx(replay_peaks(sched, costs))


def test_zbv_at_the_minimum_falls_back_to_one_microbatch_at_a_time():
    S, m = 6, 5
    costs = Costs(f=1.0, i=1.0, w=1.0, mem_b=[1.0, 0.5, 1.0, 1.0, 0.5, 1.0], mem_w=[2.0, 1.0, 0.5, 1.5, 1.0, 0.25])
    sc = costs.resolve(S)
    placement = v_placement(S)
    need = minimum_memory(placement, sc)
    # rank r: chunk 0 = stage r, chunk 1 = stage 5-r; one microbatch peaks at
    # max(mf0 + mf1, mf0 + mw1, mw0) (F, F, then I and W of chunk 1, then I of chunk 0)
    assert need == pytest.approx((2.0, 1.5, 2.5))
    assert peak_memory(sequential(S, m, placement), sc) == pytest.approx(need)
    sched = make_schedule("zbv", S, m, costs, memory_limit=list(need))
    assert all(pk <= n + TOL for pk, n in zip(simulate(sched, costs).peak_memory, need))
    with pytest.raises(ValueError, match="below one microbatch"):
        make_schedule("zbv", S, m, costs, memory_limit=[2.0, 1.4, 2.5])


def test_validator_reports_a_peak_right_after_an_i():
    costs = Costs(mem_b=1.0, mem_w=2.0)
    sched = make_schedule("zb-h1", 2, 2, costs)  # stage 1: F0 I0 F1 I1 W0 W1 -> peaks 4 after I1
    assert simulate(sched, costs).peak_memory == (3.0, 4.0)
    with pytest.raises(ScheduleError, match="rank 1: peak activation memory 4 exceeds the limit 3.5"):
        validate(sched, costs, [3.0, 3.5])
