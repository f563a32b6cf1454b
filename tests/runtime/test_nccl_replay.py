"""The runtime's posting logic replayed under NCCL's rules (`helpers/nccl_model.py`): every
schedule's lowered per-rank programs, at 2 to 8 ranks and p to 3p microbatches, run through the
real interpreter and transport, finish without deadlock, pair every message with its own, never
block the host inside a step and make no computation wait for a message it does not consume.
The replay is shown to fail on what the runtime once did: a device-wide synchronize after each
computation, and a receive posted before a send the program has before it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from helpers import nccl_model
from zbcompile.runtime.step.dispatch import Interpreter
from zbcompile.schedules import SCHEDULE_NAMES, make_schedule, schedule_spec


def _schedule(name: str, ranks: int, microbatches: int):
    """`name` at `ranks` ranks, or None where the schedule does not exist at these sizes."""
    spec = schedule_spec(name)
    try:
        return make_schedule(
            name, ranks * spec.chunks_per_rank, microbatches, time_budget=0, deterministic=True, ranks=ranks
        )
    except ValueError:
        return None


def _sizes(ranks: int) -> list[int]:
    """Microbatch counts replayed at `ranks` ranks: p, 2p+1 and 3p; every one from p to 3p with
    ZBCOMPILE_FULL_NCCL_REPLAY=1 (about five times longer)."""
    if os.environ.get("ZBCOMPILE_FULL_NCCL_REPLAY") == "1":
        return list(range(ranks, 3 * ranks + 1))
    return [ranks, 2 * ranks + 1, 3 * ranks]


CASES = [
    (name, ranks)
    for name in SCHEDULE_NAMES
    for ranks in range(2, 9)
    if not (schedule_spec(name).mirrored and ranks % 2)
]
"""Every schedule at 2 to 8 ranks; a mirrored one (dualpipe) needs an even rank count."""


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks", CASES)
def test_every_schedule_runs_without_deadlock_under_nccl_rules(name, ranks, monkeypatch):
    """With readiness followed and every wait filled with W (the most the runtime reorders);
    at m = p also the plan as lowered, without readiness."""
    replayed = 0
    for microbatches in _sizes(ranks):
        schedule = _schedule(name, ranks, microbatches)
        if schedule is None:
            continue
        assert schedule.ranks == ranks
        variants = [(True, True)] + ([(False, False)] if microbatches == ranks else [])
        for follow_readiness, fill_waits in variants:
            model = nccl_model.run_step(schedule, follow_readiness, fill_waits, monkeypatch)
            try:
                nccl_model.replay(model)
                nccl_model.check_overlap(model, schedule.stages)
            except AssertionError as error:
                raise AssertionError(
                    f"{name} p={ranks} m={microbatches} readiness={follow_readiness}: {error}"
                ) from None
        replayed += 1
    assert replayed >= 1, f"{name} has no size at {ranks} ranks among {_sizes(ranks)} microbatches"


def _replay(name: str, ranks: int, microbatches: int, monkeypatch, edit=None) -> None:
    schedule = _schedule(name, ranks, microbatches)
    model = nccl_model.run_step(schedule, False, False, monkeypatch, edit)
    nccl_model.replay(model)
    nccl_model.check_overlap(model, schedule.stages)


def test_a_device_wide_synchronize_after_each_computation_is_caught(monkeypatch):
    """As the runtime once did: `torch.cuda.synchronize()` after every F, I, B and W blocks the
    host until every receive posted ahead has landed; with receives posted before earlier sends
    (as then) it deadlocks, and in any case nothing overlaps the wait."""
    ran = Interpreter._ran

    def ran_then_synchronize(self, action, text, started):
        torch.cuda.synchronize()
        ran(self, action, text, started)

    _replay("interleaved-1f1b", 3, 6, monkeypatch)
    monkeypatch.setattr(Interpreter, "_ran", ran_then_synchronize)
    with pytest.raises(nccl_model.HostBlocked, match="device_sync"):
        _replay("interleaved-1f1b", 3, 6, monkeypatch)
    with pytest.raises(nccl_model.Deadlock, match="device_sync"):
        _replay("interleaved-1f1b", 3, 6, monkeypatch, _after_sends_to_the_same_peer_only)


def test_a_receive_posted_before_an_earlier_send_deadlocks(monkeypatch):
    """As the runtime once did: a receive posted ahead of a send to another peer that the
    program has before it. NCCL runs both on one stream, and the receive holds the send up."""
    _replay("interleaved-1f1b", 3, 6, monkeypatch)
    with pytest.raises(nccl_model.Deadlock):
        _replay("interleaved-1f1b", 3, 6, monkeypatch, _after_sends_to_the_same_peer_only)


def _after_sends_to_the_same_peer_only(program):
    """The rule the runtime once had: a receive waits only for earlier sends to its own peer."""
    messages = program.messages

    def last_send(receive):
        peer = receive.message.peer
        return max(
            (i for i in range(receive.index) if messages[i] is not None and messages[i].peer == peer), default=-1
        )

    return dataclasses.replace(
        program, receives=tuple(dataclasses.replace(r, after=last_send(r)) for r in program.receives)
    )


def test_the_model_pairs_by_order_and_catches_crossed_messages():
    """NCCL pairs the n-th send with the n-th receive between two ranks, whatever their tags:
    receives posted in the senders' order pair up, crossed ones get each other's message."""
    for received in ((1, 2), (2, 1)):
        model = nccl_model.Model(2)
        for tag in (1, 2):
            model.post("send", torch.zeros(2), 1, tag)
        model.rank = 1
        for tag in received:
            model.post("recv", torch.zeros(2), 0, tag)
        if received == (1, 2):
            nccl_model.replay(model)
        else:
            with pytest.raises(nccl_model.Mismatch, match="tag 1"):
                nccl_model.replay(model)

