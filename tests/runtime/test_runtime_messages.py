"""When the distributed runner posts its receives: ahead of the action list where the transport
pairs messages by tag (gloo), and never before an earlier send, to any peer, where it pairs
them by order (NCCL). Replays the runner's posting logic on real lowered schedules, without
processes (`test_nccl_replay.py` runs the whole interpreter under NCCL's rules)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zbcompile.runtime import readiness
from zbcompile.runtime.program import rank_program
from zbcompile.schedules import lower, make_schedule, schedule_spec


class _Recorder:
    """Stands in for the Transport: records the order in which receives are posted."""

    def __init__(self, matches_by_tag: bool) -> None:
        self.matches_by_tag = matches_by_tag
        self.log: list[tuple[str, int, str]] = []  # (kind, peer, action)

    def post_recv(self, buffers, peer, tag, action, watch=False):
        self.log.append(("recv", peer, action))
        return action


def _runner(schedule, rank: int, transport: _Recorder):
    """The parts of a runner its posting logic reads: the program (the lowered list as it is) and
    the transport."""
    rank_of = schedule.rank_of
    program = rank_program(schedule, rank, rank_of, lambda direction, stage: ("x",), lambda name: (torch.Size([1]), torch.float32), None)
    return SimpleNamespace(schedule=schedule, program=program, actions=program.actions, transport=transport, rank_of=rank_of)


def _replay(runner) -> list[tuple[str, int, str]]:
    """The runner's loop, as far as posting goes: receives ahead, sends in list order."""
    receives = readiness.ReceivesAhead(runner.program, runner.transport, torch.device("cpu"), lambda key: False)
    for index, action in enumerate(runner.actions):
        receives.post_ahead(index)
        if action.kind.startswith("RECV"):
            receives.post_through(index)
        elif action.kind == "SEND_F":
            runner.transport.log.append(("send", runner.rank_of(action.stage + 1, action.microbatch), str(action)))
        elif action.kind == "SEND_B":
            runner.transport.log.append(("send", runner.rank_of(action.stage - 1, action.microbatch), str(action)))
    return runner.transport.log


CASES = [("1f1b", 4, 8), ("zb-h1", 4, 8), ("zbv", 2, 6), ("interleaved-1f1b", 2, 4), ("dualpipe", 4, 8)]


@pytest.mark.parametrize("name, ranks, microbatches", CASES)
def test_every_receive_is_posted_once_by_the_time_the_list_reaches_it(name, ranks, microbatches):
    schedule = make_schedule(name, ranks * schedule_spec(name).chunks_per_rank, microbatches)
    for rank in range(ranks):
        for by_tag in (True, False):
            log = _replay(_runner(schedule, rank, _Recorder(by_tag)))
            listed = [str(a) for a in lower(schedule).actions[rank] if a.kind.startswith("RECV")]
            posted = [action for kind, _, action in log if kind == "recv"]
            assert posted == listed  # each once, in list order
            position = {str(a): i for i, a in enumerate(lower(schedule).actions[rank])}
            posted_at = 0
            for kind, _, action in log:  # a receive is posted no later than its place in the list
                if kind == "send":
                    posted_at = position[action]
                else:
                    assert posted_at <= position[action], action


@pytest.mark.parametrize("name, ranks, microbatches", CASES)
def test_ordered_transport_keeps_the_lists_order_of_operations(name, ranks, microbatches):
    """With pairing by order, sends and receives, whatever their peers, are posted exactly in
    list order (NCCL runs them on one stream in the order posted)."""
    schedule = make_schedule(name, ranks * schedule_spec(name).chunks_per_rank, microbatches)
    for rank in range(ranks):
        runner = _runner(schedule, rank, _Recorder(matches_by_tag=False))
        log = _replay(runner)
        assert [a for _, _, a in log] == [str(a) for a in runner.actions if not a.is_compute], rank


def test_gloo_posts_receives_ahead_of_the_list():
    """Pairing by tag, the last stage of 1F1B has its next forward inputs posted while it is
    still computing: some receive is posted before an earlier send in its list."""
    schedule = make_schedule("1f1b", 2, 8)
    runner = _runner(schedule, 1, _Recorder(matches_by_tag=True))
    log = _replay(runner)
    position = {str(a): i for i, a in enumerate(runner.actions)}
    order = [position[a] for _, _, a in log]
    assert order != sorted(order)
