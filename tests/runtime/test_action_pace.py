"""Emulated action and link times (`runtime/step/action_pace.py`), the rehearsal's schedules
(`rehearse.prepare`, the paper's settings) and torch's emulated chunk (`rehearsal/torch_schedules.py`):
each sleep on the path it stands for, and only there, read from a recorded clock (no test here
times anything)."""

from __future__ import annotations

import pytest
import torch

from zbcompile.rehearsal import torch_schedules
from zbcompile.rehearsal.rehearse import Rehearsal, paper_times, prepare
from zbcompile.rehearsal.torch_schedules import EmulatedChunk
from zbcompile.runtime.step import action_pace, transport
from zbcompile.runtime.step.action_pace import Emulated, Slowed
from zbcompile.runtime.step.transport import Pending, _Poster
from zbcompile.schedules import Action, Costs, simulate
from zbcompile.schedules.costs import EmulatedTimes


class RecordedClock:
    """A clock whose sleeps pass at once and are recorded: what a pace asks to wait, read without timing."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds

    def sleep_until(self, deadline: float) -> None:
        if deadline > self.now:
            self.sleep(deadline - self.now)


def test_an_emulated_action_waits_out_its_time_whatever_its_own_work_took(monkeypatch):
    clock = RecordedClock()
    monkeypatch.setattr(action_pace, "time", clock)
    pace = Emulated(EmulatedTimes.of(Costs(f=30, i=20, w=10), 2))
    for kind, want in (("F", 0.030), ("I", 0.020), ("W", 0.010), ("B", 0.030)):
        clock.slept.clear()
        pace.wait(Action.parse(f"1{kind}0"), 0.004)  # the stand-in's own work took 4 ms
        assert clock.slept == [round(want - 0.004, 9)], kind
    clock.slept.clear()
    pace.wait(Action.parse("1F0"), 0.050)  # longer than its time: it keeps its own
    assert clock.slept == []
    pace.late_s = 0.5e-3  # a sleep is cut short by the lateness seen so far
    pace.wait(Action.parse("1W0"), 0.0)
    assert clock.slept == [round(0.010 - 0.5e-3, 9)]
    Slowed(2.0).wait(Action.parse("0F0"), 0.01)
    assert clock.slept[-1] == 0.01


def test_emulated_times_name_the_stages_they_are_for():
    with pytest.raises(ValueError, match="3 values but the schedule has 2 stages"):
        EmulatedTimes.of(Costs(f=[1, 2, 3]), 2)
    with pytest.raises(ValueError, match="unit_s must be positive"):
        EmulatedTimes.of(Costs(), 2, unit_s=0)


def test_a_send_is_posted_no_sooner_than_the_link_time_after_it_was_given(monkeypatch):
    waited: list[float] = []  # the deadlines the send thread waits for, in order
    monkeypatch.setattr(transport, "sleep_until", waited.append)
    poster = _Poster("test-poster")
    posted: list[str] = []
    for k in range(3):
        poster.post(Pending([], [], 1, f"0SEND_F{k}"), lambda k=k: posted.append(f"0SEND_F{k}") or [], 10.0 + k)
    poster.stop()
    poster.thread.join(timeout=30)
    assert waited == [10.0, 11.0, 12.0]  # each waits for its own time, after the ones given before it
    assert posted == ["0SEND_F0", "0SEND_F1", "0SEND_F2"]


def test_torch_chunk_sleeps_i_on_the_input_path_and_w_on_the_weight_path(monkeypatch):
    clock = RecordedClock()
    monkeypatch.setattr(torch_schedules, "time", clock)
    monkeypatch.setattr(torch_schedules, "sleep_until", clock.sleep_until)
    chunk = EmulatedChunk(4, f_s=0.02, i_s=0.03, w_s=0.3, link_s=0.0, last=True)
    x = torch.cat([torch.randn(2, 4), torch.zeros(2, 1)], dim=-1).requires_grad_()
    y = chunk(x)
    assert clock.slept == [0.02]  # F: its time (the clock stands still while it computes)
    grad = torch.ones_like(y)

    def slept(fn) -> list[float]:
        clock.slept.clear()
        fn()
        return sorted(clock.slept)

    assert slept(lambda: torch.autograd.grad(y, [x], grad, retain_graph=True)) == [0.03]  # I alone
    assert slept(lambda: torch.autograd.grad(y, [chunk.b], grad, retain_graph=True)) == [0.3]  # W alone
    assert slept(lambda: y.backward(grad)) == [0.03, 0.3]  # a fused backward: both


def test_the_rehearsal_runs_zb_1p_and_zb_2p_in_1f1b_memory_and_twice_it_and_a_v_in_chunks():
    settings = Rehearsal(4, 8, Costs(f=2, i=2, w=1), schedules=("1f1b", "zb-1p", "zb-2p", "zbv"))
    prepared = {p.name: p for p in prepare(settings)}
    one_f_one_b = max(simulate(prepared["1f1b"].schedule, prepared["1f1b"].costs).peak_memory)
    assert max(simulate(prepared["zb-1p"].schedule, prepared["zb-1p"].costs).peak_memory) <= one_f_one_b
    assert max(simulate(prepared["zb-2p"].schedule, prepared["zb-2p"].costs).peak_memory) <= 2 * one_f_one_b
    zbv = prepared["zbv"]
    assert zbv.schedule.stages == 8 and zbv.costs.f == (1.0,) * 8 and zbv.schedule.ranks == 4


def test_the_papers_settings_predict_table_5s_bubbles():
    """Table 9's times for the 1.5B model at m=24 (p=8): the simulator's per-stage bubble of each
    handcrafted schedule and of ZB-1p is the paper's Table 5 figure (its own profiles, within 0.005)."""
    settings = paper_times("1.5B", schedules=("1f1b", "zb-h1", "zb-h2", "zb-1p"))
    assert (settings.ranks, settings.microbatches) == (8, 24)
    table5 = {"1f1b": 0.2431, "zb-h1": 0.1585, "zb-h2": 0.1083, "zb-1p": 0.1585}
    for p in prepare(settings):
        assert simulate(p.schedule, p.costs).stage_bubble_rate == pytest.approx(table5[p.name], abs=0.005), p.name
    scaled = paper_times("28.3B", 128, 4.0)  # Table 9's costs as they are, each unit 4 ms long
    assert (scaled.ranks, scaled.microbatches, scaled.unit_s, scaled.label) == (32, 128, 4e-3, "28.3B, m=128, times x4")
    with pytest.raises(ValueError, match="choose one of 1.5B"):
        paper_times("7B")
    with pytest.raises(ValueError, match="no torch schedule 'Schedule2F2B'.*Schedule1F1B"):
        Rehearsal(2, 2, Costs(), torch_schedules=("Schedule2F2B",))


def test_emulated_replicas_reduce_each_stage_after_its_last_w_one_at_a_time_on_the_link(monkeypatch):
    """Two chunks on a rank (a V's 0 and 3): each stage's reduction is posted when its last W has
    run, in the order of the last W, waits for the one before it on the link, lasts its seconds,
    and the step's gradients come back only once the last has ended."""
    from zbcompile.runtime.parallel.grad_reduction import ReductionPlan
    from zbcompile.runtime.step.action_pace import EmulatedReduction

    clock = RecordedClock()
    monkeypatch.setattr(action_pace, "time", clock)
    actions = [Action.parse(t) for t in ("0F0", "3F0", "3I0", "3W0", "0I0", "0W0")]
    plan = ReductionPlan.of(actions, {0: ["a"], 3: ["b"]}, [])
    reduction = EmulatedReduction(plan, [0.02, 0, 0, 0.03])
    reduction.ran(3)
    posted_3 = clock.perf_counter()
    reduction.ran(0)  # while 3's is still on the link
    assert [label for label, _, _ in reduction.timeline] == ["REDUCE 3", "REDUCE 0"]
    (_, start_3, end_3), (_, start_0, end_0) = reduction.timeline
    assert start_3 == posted_3 and end_3 - start_3 == pytest.approx(0.03)
    assert start_0 == end_3 and end_0 - start_0 == pytest.approx(0.02)
    assert clock.slept == []  # posting waits for nothing: the link runs beside the computations
    assert reduction.finish() == {} and clock.slept == [pytest.approx(0.05)]  # the step waits for the last
    unfinished = EmulatedReduction(plan, [0.02, 0, 0, 0.03])
    unfinished.ran(3)
    with pytest.raises(RuntimeError, match="stage 0 ran 0 of its 1 gradient actions"):
        unfinished.finish()
