"""A rank's program: W deferred past sends keep their order, every message keeps its place
relative to the others, the rank's activation memory stays within the plan's peak, and the
programs stay deadlock-free. Pure schedule-level checks, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zbcompile.runtime.step.rank_program import ACTIVATIONS, defer_weights, rank_program
from zbcompile.schedules import Costs, lower, make_schedule
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.lower import check_rendezvous
from zbcompile.schedules.simulate import peak_memory

CASES = [
    ("zb-h1", 2, 8, Costs(mem_b=1.0, mem_w=0.5)),
    ("zb-h2", 2, 8, Costs(mem_b=1.0, mem_w=0.5)),
    ("zb-h2", 4, 8, Costs(mem_b=[1, 1, 1, 1], mem_w=[1.0, 0.6, 0.4, 1.2])),
    ("zb-auto", 2, 8, Costs(f=[3.5, 3.7], i=[0.1, 4.3], w=[6.8, 2.9], comm=0.2, mem_b=1.0, mem_w=[1.0, 0.5])),
    ("zb-auto", 4, 6, Costs(mem_b=1.0, mem_w=0.5)),
    ("zbv", 4, 6, Costs(mem_b=1.0, mem_w=0.5)),
]


def _deferred(name, stages, microbatches, costs):
    schedule = make_schedule(name, stages, microbatches, costs=costs, time_budget=0)
    memory = resolve_costs(costs, stages)
    lowered = lower(schedule)
    rows = [defer_weights(row, memory) for row in lowered.actions]
    return schedule, lowered, memory, rows


@pytest.mark.parametrize("name, stages, microbatches, costs", CASES)
def test_deferral_keeps_every_order_but_where_w_runs(name, stages, microbatches, costs):
    _, lowered, _, rows = _deferred(name, stages, microbatches, costs)
    for before, (after, moved) in zip(lowered.actions, rows):
        assert sorted(before) == sorted(after)
        assert [a for a in before if a.kind != "W"] == [a for a in after if a.kind != "W"]
        assert [a for a in before if a.kind == "W"] == [a for a in after if a.kind == "W"]
        for text in moved:  # a moved W now follows a send it preceded
            w = next(a for a in after if str(a) == text)
            position = after.index(w)
            sends_before = {a for a in after[:position] if a.kind.startswith("SEND")}
            was_before = {a for a in before[: before.index(w)] if a.kind.startswith("SEND")}
            assert sends_before > was_before, text


@pytest.mark.parametrize("name, stages, microbatches, costs", CASES)
def test_deferral_stays_within_the_plans_memory_and_deadlock_free(name, stages, microbatches, costs):
    schedule, lowered, memory, rows = _deferred(name, stages, microbatches, costs)
    deferred = replace(lowered, actions=tuple(row for row, _ in rows))
    plan_peaks = peak_memory(schedule, memory)
    for plan, peak in zip(plan_peaks, peak_memory(deferred.compute_only(), memory)):
        assert peak <= plan + 1e-9
    check_rendezvous(deferred)


def test_zero_bubble_schedules_move_some_w():
    """On a stage whose W needs less memory than F keeps, the tail of ZB-H2 and zb-auto leaves
    room to hold W past the next send."""
    for name, stages, microbatches, costs in CASES:
        if name in ("zb-h2", "zb-auto"):
            _, _, _, rows = _deferred(name, stages, microbatches, costs)
            assert any(moved for _, moved in rows), name


def test_memory_bound_w_stay_in_place():
    """W as large as F's activations on every stage: holding one past a forward would lift ZB-H1's
    peak, so nothing moves."""
    _, lowered, _, rows = _deferred("zb-h1", 2, 8, Costs(mem_b=1.0, mem_w=1.0))
    assert all(not moved for _, moved in rows)
    assert [row for row, _ in rows] == list(lowered.actions)


def test_program_resolves_messages():
    schedule = make_schedule("zb-h1", 2, 4)
    shapes = {"x": (torch.Size([2, 3]), torch.float32), "g": (torch.Size([2, 3]), torch.float16)}
    program = rank_program(
        schedule, 1, lambda s, k: 10 + s, lambda d, s: ("x",) if d == ACTIVATIONS else ("g",), shapes.__getitem__, None
    )
    assert program.actions == lower(schedule).actions[1]
    assert [r.message.text for r in program.receives] == [str(a) for a in program.actions if a.kind.startswith("RECV")]
    first = program.receives[0]
    assert first.message.peer == 10 and first.message.names == ("x",) and first.layouts == (shapes["x"],)
    sends = [m for m in program.messages if m is not None]
    assert [m.text for m in sends] == [str(a) for a in program.actions if a.kind.startswith("SEND")]
    assert all(m.peer == 10 and m.names == ("g",) and m.stage == 0 for m in sends)
    assert len({m.tag for m in sends} | {r.message.tag for r in program.receives}) == len(sends) + len(program.receives)
    assert program.weight_order == tuple(a for a in program.actions if a.kind == "W") and program.deferred == ()
    assert program.overtaken == {}


def test_overtaken_w_are_those_the_plan_ran_before_the_waiting_computation():
    costs = Costs(f=[3.5, 3.7], i=[0.1, 4.3], w=[6.8, 2.9], comm=0.2, mem_b=1.0, mem_w=[1.0, 0.5])
    schedule = make_schedule("zb-auto", 2, 8, costs=costs, time_budget=0)
    for rank in range(2):
        plan = lower(schedule).actions[rank]
        program = rank_program(
            schedule,
            rank,
            lambda s, k: s,
            lambda d, s: ("x",),
            lambda n: (torch.Size([1]), torch.float32),
            resolve_costs(costs, 2),
        )
        assert program.overtaken or not program.deferred
        for (carries, stage, k), weights in program.overtaken.items():
            waiting = next(
                a
                for a in program.actions
                if a.stage == stage and a.microbatch == k and a.kind == ("F" if carries == ACTIVATIONS else "I")
            )
            for w in weights:
                assert plan.index(w) < plan.index(waiting) and program.actions.index(w) > program.actions.index(waiting)


def test_wait_forecast_runs_a_w_only_where_recent_waits_had_room_for_it():
    from zbcompile.runtime.step.readiness import WaitForecast

    forecast = WaitForecast()
    key = (ACTIVATIONS, 1, 3)
    assert not forecast.worth_watching(key) and not forecast.fits(key, 0.0, 1)  # nothing seen yet
    forecast.note_weight(1, 0.004)
    forecast.end_step()
    for lateness in (0.010, 0.002, 0.012):
        forecast.note_wait(key, lateness)
    assert forecast.worth_watching(key)  # median 10 ms >= 4 ms
    assert forecast.fits(key, 0.0, 1) and forecast.fits(key, 0.006, 1) and not forecast.fits(key, 0.0061, 1)
    assert not forecast.fits((ACTIVATIONS, 1, 4), 0.0, 1)
    for lateness in (0.001, 0.001):  # the message came on time since: no room
        forecast.note_wait(key, lateness)
    assert not forecast.worth_watching(key) and not forecast.fits(key, 0.0, 1)
