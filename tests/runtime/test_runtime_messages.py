"""When the distributed runner posts its receives: ahead of the action list where the transport
pairs messages by tag (gloo), and never before an earlier send, to any peer, where it pairs
them by order (NCCL). One step of each rank of real lowered schedules runs through the runtime's
own interpreter (`runtime/dispatch.Interpreter`, with `readiness.ReceivesAhead`) over a
transport that records what is posted, without processes; a change to the runtime's posting
order is what these tests see (`test_nccl_replay.py` replays the same interpreter under NCCL's
pairing rules)."""

from __future__ import annotations

import pytest
import torch

from helpers.recording_rank import LAYOUT, NAMES, RecordingStage, RecordingTransport
from zbcompile.runtime.step import readiness
from zbcompile.runtime.step.dispatch import Interpreter
from zbcompile.runtime.step.rank_program import rank_program
from zbcompile.schedules import Costs, lower, make_schedule, schedule_spec
from zbcompile.schedules.costs import resolve_costs


def _step(schedule, rank: int, matches_by_tag: bool, deferred: bool):
    """One step of `rank`'s program through the interpreter; returns (the program, the log of
    what it computed, sent and posted, in order). `deferred`: the program as the distributed
    runner makes it when it follows readiness (W moved past sends, `program.defer_weights`),
    else the lowered list as it is."""
    stages = schedule.stages
    memory = resolve_costs(Costs(mem_b=[1.0] * stages, mem_w=[0.5] * stages), stages) if deferred else None
    program = rank_program(
        schedule, rank, schedule.rank_of, lambda carries, stage: NAMES, lambda name: LAYOUT, memory
    )
    log: list[tuple[str, int, str]] = []
    executors = {s: RecordingStage(s, stages - 1, log) for s in schedule.stages_on(rank)}
    interpreter = Interpreter(executors, RecordingTransport(matches_by_tag, log), torch.device("cpu"), deferred)
    interpreter.load(program, schedule)
    m = schedule.microbatches
    interpreter.step([{"input": torch.zeros(2)} for _ in range(m)], [{} for _ in range(m)])
    return program, log


def _check_every_receive_posted_in_time(schedule, rank: int, matches_by_tag: bool, deferred: bool) -> None:
    """Every RECV of the program is posted once, in list order, and before anything the list
    has after it is computed or sent."""
    program, log = _step(schedule, rank, matches_by_tag, deferred)
    texts = [str(a) for a in program.actions]
    listed = [str(a) for a in program.actions if a.kind.startswith("RECV")]
    assert [action for kind, _, action in log if kind == "recv"] == listed, f"rank {rank}"  # each once, in list order
    position = {t: i for i, t in enumerate(texts)}
    reached = -1  # the furthest list position run so far
    for kind, _, action in log:
        if kind == "recv":
            assert reached < position[action], f"rank {rank}: {action} posted after the list ran {texts[reached]}"
        else:
            reached = max(reached, position[action])


def _check_list_order_of_operations(schedule, rank: int, deferred: bool) -> None:
    """Pairing by order: sends and receives, whatever their peers, are posted exactly in list
    order, each to the peer the list names."""
    program, log = _step(schedule, rank, matches_by_tag=False, deferred=deferred)
    posted = [(kind, peer, action) for kind, peer, action in log if kind != "compute"]
    expected = [
        ("send" if a.kind.startswith("SEND") else "recv", _peer(schedule, a), str(a))
        for a in program.actions
        if not a.is_compute
    ]
    assert posted == expected, f"rank {rank}"


def _peer(schedule, action) -> int:
    """The rank at the other end of a SEND or RECV."""
    s, k = action.stage, action.microbatch
    other = {"SEND_F": s + 1, "SEND_B": s - 1, "RECV_F": s - 1, "RECV_B": s + 1}[action.kind]
    return schedule.rank_of(other, k)


CASES = [("1f1b", 4, 8), ("zb-h1", 4, 8), ("zbv", 2, 6), ("interleaved-1f1b", 2, 4), ("dualpipe", 4, 8)]


def _schedule(name: str, ranks: int, microbatches: int):
    return make_schedule(name, ranks * schedule_spec(name).chunks_per_rank, microbatches)


@pytest.mark.parametrize("name, ranks, microbatches", CASES)
def test_every_receive_is_posted_once_by_the_time_the_list_reaches_it(name, ranks, microbatches):
    schedule = _schedule(name, ranks, microbatches)
    for rank in range(ranks):
        assert [
            a
            for a in rank_program(schedule, rank, schedule.rank_of, lambda d, s: NAMES, lambda n: LAYOUT, None).actions
        ] == list(lower(schedule).actions[rank])
        for by_tag in (True, False):
            for deferred in (False, True):
                _check_every_receive_posted_in_time(schedule, rank, by_tag, deferred)


@pytest.mark.parametrize("name, ranks, microbatches", CASES)
def test_ordered_transport_keeps_the_lists_order_of_operations(name, ranks, microbatches):
    """With pairing by order, sends and receives, whatever their peers, are posted exactly in
    list order (NCCL runs them on one stream in the order posted)."""
    schedule = _schedule(name, ranks, microbatches)
    for rank in range(ranks):
        for deferred in (False, True):
            _check_list_order_of_operations(schedule, rank, deferred)


def test_gloo_posts_receives_ahead_of_the_list():
    """Pairing by tag, the last stage of 1F1B has its next forward inputs posted while it is
    still computing: some receive is posted before an earlier send or computation in its list."""
    schedule = make_schedule("1f1b", 2, 8)
    program, log = _step(schedule, 1, matches_by_tag=True, deferred=False)
    position = {str(a): i for i, a in enumerate(program.actions)}
    order = [position[a] for _, _, a in log]
    assert order != sorted(order)


def test_a_receive_posted_ahead_of_an_earlier_send_is_caught(monkeypatch):
    """The checks see the runtime's posting: with `ReceivesAhead` posting ahead as for gloo on
    a transport that pairs by order (a receive before a send the list has before it, which
    deadlocks under NCCL), the list-order check fails."""
    schedule = _schedule("1f1b", 4, 8)
    _check_list_order_of_operations(schedule, 1, deferred=False)
    init = readiness.ReceivesAhead.__init__

    def ahead_whatever_the_transport(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.in_order = False

    monkeypatch.setattr(readiness.ReceivesAhead, "__init__", ahead_whatever_the_transport)
    with pytest.raises(AssertionError, match="rank 1"):
        _check_list_order_of_operations(schedule, 1, deferred=False)


def test_a_receive_posted_only_when_its_data_is_needed_is_caught(monkeypatch):
    """The checks see the runtime's posting: with the interpreter posting a receive only once a
    computation needs its data (its RECV action posting nothing), receives come after what the
    list has between the RECV and that computation."""
    schedule = _schedule("1f1b", 4, 8)
    _check_every_receive_posted_in_time(schedule, 1, matches_by_tag=False, deferred=False)
    monkeypatch.setattr(readiness.ReceivesAhead, "post_ahead", lambda self, index: None)
    monkeypatch.setattr(readiness.Mailbox, "receive", lambda self, index, action: None)
    take = readiness.ReceivesAhead.take

    def post_then_take(self, key):
        while key not in self.posted:
            self._post_next()
        return take(self, key)

    monkeypatch.setattr(readiness.ReceivesAhead, "take", post_then_take)
    with pytest.raises(AssertionError, match="posted after the list ran"):
        _check_every_receive_posted_in_time(schedule, 1, matches_by_tag=False, deferred=False)
