"""Following readiness on logical time: the last rank of a zb-h2 pipeline runs its program through
the runtime's own interpreter (`runtime/dispatch.Interpreter`, its `readiness.WaitForecast`)
with computations of fixed length (F, I, W: 1 logical second each) and forward messages that
arrive at fixed times (`helpers.recording_rank`). Which W move into a wait then follows from
the program and those numbers alone, whatever the machine's speed."""

from __future__ import annotations

import pytest
import torch

from helpers.recording_rank import LAYOUT, NAMES, LateTransport, LogicalClock, TimedStage
from zbcompile.runtime.step.dispatch import Interpreter
from zbcompile.runtime.step.rank_program import rank_program
from zbcompile.schedules import Action, Costs, make_schedule
from zbcompile.schedules.costs import resolve_costs

SCHEDULE = make_schedule("zb-h2", 2, 4)
RANK = 1  # the last stage: it waits for the first rank's forward messages
STEPS = 3


def _late_forwards(first: float, gap: float) -> dict[str, float]:
    """Forward message k reaches the last rank `first + k * gap` seconds into the step."""
    return {f"1RECV_F{k}": first + k * gap for k in range(SCHEDULE.microbatches)}


def _steps(arrivals: dict[str, float], follow_readiness: bool, w_seconds: float = 1.0) -> list[dict]:
    """`STEPS` steps of the last rank's program (W deferred past sends where readiness is
    followed, as the distributed runner does); per step: the W run in a wait, the computations
    as (action, start, end) in logical seconds, and the waits as (message, reached, arrived)."""
    memory = resolve_costs(Costs(mem_b=[1.0] * 2, mem_w=[0.5] * 2), 2) if follow_readiness else None
    program = rank_program(SCHEDULE, RANK, SCHEDULE.rank_of, lambda carries, stage: NAMES, lambda n: LAYOUT, memory)
    clock, log = LogicalClock(), []
    seconds = {"F": 1.0, "I": 1.0, "B": 2.0, "W": w_seconds}
    executors = {s: TimedStage(s, 1, log, clock, seconds) for s in SCHEDULE.stages_on(RANK)}
    interpreter = Interpreter(executors, LateTransport(clock, arrivals, log), torch.device("cpu"), follow_readiness,
                              clock=clock)
    interpreter.load(program, SCHEDULE)
    seen = []
    waits = []
    record = clock.record

    def keep_waits(timeline, label, started, ended=None):
        if timeline == "wait":
            waits.append((label, started, ended))
        record(timeline, label, started, ended)

    clock.record = keep_waits
    m = SCHEDULE.microbatches
    for _ in range(STEPS):
        waits.clear()
        del log[:]
        interpreter.step([{"input": torch.zeros(2)} for _ in range(m)], [{} for _ in range(m)])
        computed = [a for kind, _, a in log if kind == "compute"]
        assert [a for a in computed if Action.parse(a).kind == "W"] == [str(w) for w in program.weight_order]
        seen.append({"into_wait": interpreter.early_w, "timeline": list(interpreter.timeline), "waits": list(waits),
                     "computed": computed, "program": program})
    return seen


def _span(step: dict) -> float:
    return max(end for _, _, end in step["timeline"])


def test_a_late_message_takes_the_overtaken_w_at_once_and_what_fits_once_measured():
    """Forward messages 3 s apart (the sender is the slower rank). The first step knows no
    lateness yet: only the W the plan ran before the waiting F (overtaken by the deferral past a
    send) runs in that wait. From the second step the forecast has measured each message 1 s
    late and a W as 1 s: every W whose I has run goes into a wait it fits; none makes its
    computation later than the message's arrival, and the step is shorter than the plan's."""
    arrivals = _late_forwards(first=2.0, gap=3.0)
    followed, planned = _steps(arrivals, True), _steps(arrivals, False)
    program = followed[0]["program"]
    assert program.deferred == ("1W0",)  # the plan's W0 came before SEND_B1; it now follows it
    assert followed[0]["into_wait"] == ("1W0",)
    assert {str(w) for w in program.overtaken[("activations", 1, 1)]} == {"1W0"}
    for step in followed[1:]:
        assert step["into_wait"] == ("1W0", "1W1", "1W2"), step["into_wait"]
        started = {a: start for a, start, _ in step["timeline"]}
        ended = {a: end for a, _, end in step["timeline"]}
        for w in step["into_wait"]:  # each ran before a computation the program puts first
            before = [a for a in step["computed"][: step["computed"].index(w)]]
            listed = [str(a) for a in program.actions[: program.actions.index(Action.parse(w))] if a.is_compute]
            assert set(listed) - set(before), (w, before)
        for (_, stage, k), reached, arrived in step["waits"]:  # no W held a computation past its message
            if arrived > reached:
                assert started[f"{stage}F{k}"] == arrived, (k, step["timeline"])
        assert max(ended.values()) == _span(step)
    assert _span(followed[-1]) < _span(followed[0]) == _span(planned[0])
    for step in planned:
        assert step["into_wait"] == () and step["program"].deferred == ()


@pytest.mark.parametrize("arrivals", [{}, _late_forwards(first=2.0, gap=3.0)], ids=["on-time", "late-by-less-than-a-w"])
def test_no_w_moves_into_a_wait_it_does_not_fit(arrivals):
    """Messages there when needed, or late by 1 s where a W lasts 2 s: no W goes into a wait but
    the overtaken one, which the plan ran before the waiting F anyway, where its message is late."""
    for step in _steps(arrivals, True, w_seconds=2.0):
        late = {k for k, reached, arrived in step["waits"] if arrived > reached}
        assert step["into_wait"] == (("1W0",) if ("activations", 1, 1) in late else ()), (step["into_wait"], late)
        assert bool(late) == bool(arrivals)


def test_a_wait_takes_the_w_that_fit_and_no_more():
    """F3's message 1.5 s late where a W lasts 1 s: once measured, W1 goes into that wait and W2,
    which would end after the message arrived, does not (F3 starts as it arrives)."""
    arrivals = {"1RECV_F1": 5.0, "1RECV_F3": 10.5}
    for step in _steps(arrivals, True)[1:]:
        assert step["into_wait"] == ("1W0", "1W1"), step["into_wait"]
        assert {a: start for a, start, _ in step["timeline"]}["1F3"] == 10.5, step["timeline"]
