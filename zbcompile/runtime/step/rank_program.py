"""A rank's part of a pipeline schedule, resolved once per schedule so that a step only follows
it (the interpreter, `runtime/step/dispatch.py`; one process running every rank follows all their
parts merged): the lowered action list, each message's peer, tag, value names and buffer
layouts, the receives in posting order, and where weight-gradient (W) work runs.

No other rank waits for a W, so where a W runs changes no message, and as long as each stage's
W keep the plan's order, no sum either (gradients stay bitwise equal). `defer_weights` moves W
that the plan runs before a send to just after that send, so the message leaves sooner, unless
that would lift the rank's activation memory above the plan's own peak or take a W past a fused
backward B of its stage's later microbatch (a stage adds its gradients in microbatch order). The runner may in turn
run the next W early, while it waits for a message that has not arrived; a W the plan ran
before the waiting computation (`RankProgram.overtaken`) it runs there as the plan would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from zbcompile.runtime.step.flat_message import TensorLayout
from zbcompile.schedules import Action, Schedule, lower
from zbcompile.schedules.fusion import gradients_in_order
from zbcompile.schedules.timing import asap_timing


class MemoryModel(Protocol):
    """The simulator's memory model (costs resolved per stage, `schedules.costs.resolve_costs`)."""

    def memory_delta(self, stage: int, kind: str) -> float: ...

    def memory_rise(self, stage: int, kind: str) -> float: ...


ACTIVATIONS = "activations"  # what a stage's F sends the next stage (SEND_F, RECV_F)
GRADIENTS = "gradients"  # what a stage's I or B sends the previous stage (SEND_B, RECV_B: the schedule format's letter)
CARRIED_BY = {"SEND_F": ACTIVATIONS, "RECV_F": ACTIVATIONS, "SEND_B": GRADIENTS, "RECV_B": GRADIENTS}


@dataclass(frozen=True)
class Message:
    """The values one stage sends another for one microbatch: `carries` ACTIVATIONS (from
    stage - 1) or GRADIENTS (of the stage's outputs, from stage + 1) into `stage`. `peer` is the
    global rank at the other end (receiver of a SEND, sender of a RECV); `text` the SEND or RECV
    action."""

    carries: str
    stage: int
    microbatch: int
    peer: int
    tag: int
    names: tuple[str, ...]
    text: str
    key: tuple[str, int, int] = field(init=False)  # (carries, stage, microbatch), read by a step

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.carries, self.stage, self.microbatch))


@dataclass(frozen=True)
class Receive:
    """A RECV at position `index` of the program; `after` is the position of the last SEND
    before it, to any peer (-1: none); `layouts` the (shape, dtype) of each value."""

    message: Message
    index: int
    after: int
    layouts: tuple[TensorLayout, ...]


@dataclass(frozen=True)
class RankProgram:
    """What one rank runs in a step. `messages[i]` is the message of a SEND at position i (None
    elsewhere); `weight_order` the W actions in program order (the order they must run in);
    `deferred` the W that the program runs after a send the plan ran them before;
    `overtaken[key]` the W that the plan runs before the computation waiting for message `key`
    and the program after it."""

    actions: tuple[Action, ...]
    texts: tuple[str, ...]
    messages: tuple[Message | None, ...]
    receives: tuple[Receive, ...]
    weight_order: tuple[Action, ...]
    deferred: tuple[str, ...]
    overtaken: dict[tuple[str, int, int], frozenset[Action]]


def message_tag(carries: str, stage: int, microbatch: int, stages: int) -> int:
    """A distinct tag per message of a step (gloo matches messages by tag)."""
    return (microbatch * stages + stage) * 2 + (carries == GRADIENTS)


def rank_program(
    schedule: Schedule,
    pp_rank: int,
    rank_of: Callable[[int, int], int],
    names: Callable[[str, int], Sequence[str]],
    layout: Callable[[str], TensorLayout],
    memory: MemoryModel | None,
) -> RankProgram:
    """Position `pp_rank`'s program for `schedule`. `rank_of(stage, microbatch)`: the global rank
    running a stage for a microbatch; `names(carries, stage)`: the values a message of ACTIVATIONS or GRADIENTS into
    that stage holds; `layout(name)`: a value's (shape, dtype). With `memory` (the memory model of the
    schedule's costs), W are deferred past sends within the plan's peak; without, the lowered
    list is kept as it is."""
    planned = actions = lower(schedule).actions[pp_rank]
    deferred: tuple[str, ...] = ()
    if memory is not None:
        actions, deferred = defer_weights(planned, memory)
    return _resolve(schedule, planned, actions, deferred, rank_of, names, layout)


def single_process_program(
    schedule: Schedule, names: Callable[[str, int], Sequence[str]], layout: Callable[[str], TensorLayout]
) -> RankProgram:
    """The program of one process that runs every rank of `schedule`: every rank's lowered list
    as it is, merged so that each compute action comes where `execution_order` puts it, with
    the messages its list has after it (its SEND first) right behind it. Ranks are positions
    (`rank_of` is `schedule.rank_of`); `names`, `layout` as for `rank_program`."""
    lowered = lower(schedule).actions
    rank = {a: r for r, row in enumerate(lowered) for a in row if a.is_compute}
    cursor = [0] * len(lowered)
    actions: list[Action] = []
    for action in execution_order(schedule):
        row, i = lowered[rank[action]], cursor[rank[action]]
        while row[i] != action:  # the receives its list posts before it
            actions.append(row[i])
            i += 1
        actions.append(action)
        i += 1
        while i < len(row) and not row[i].is_compute:
            actions.append(row[i])
            i += 1
        cursor[rank[action]] = i
    return _resolve(schedule, actions, actions, (), schedule.rank_of, names, layout)


def execution_order(schedule: Schedule) -> list[Action]:
    """All compute actions in an order that respects each rank's list and every dependency."""
    timing = asap_timing(schedule.actions, schedule.stages, schedule.stage_to_rank, lambda a: 1.0, 0.0)
    rank = {a: r for r, row in enumerate(schedule.actions) for a in row}
    return sorted(timing.start, key=lambda a: (timing.start[a], rank[a]))


def _resolve(
    schedule: Schedule, planned: Sequence[Action], actions: Sequence[Action], deferred: tuple[str, ...],
    rank_of: Callable[[int, int], int], names: Callable[[str, int], Sequence[str]],
    layout: Callable[[str], TensorLayout],
) -> RankProgram:
    """The program running `actions` (`planned`, with the W in `deferred` moved past sends):
    each message's peer, tag, value names and buffer layouts resolved."""
    messages: list[Message | None] = []
    receives: list[Receive] = []
    last_send = -1
    for index, action in enumerate(actions):
        s, k, kind = action.stage, action.microbatch, action.kind
        message = None
        if kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
            carries = CARRIED_BY[kind]
            receiver = {"SEND_F": s + 1, "SEND_B": s - 1}.get(kind, s)
            sender = {"RECV_F": s - 1, "RECV_B": s + 1}.get(kind, s)
            peer = rank_of(receiver if kind.startswith("SEND") else sender, k)
            value_names = tuple(names(carries, receiver))
            tag = message_tag(carries, receiver, k, schedule.stages)
            message = Message(carries, receiver, k, peer, tag, value_names, str(action))
            if kind.startswith("SEND"):
                last_send = index
            else:
                receives.append(Receive(message, index, last_send, tuple(layout(n) for n in value_names)))
        messages.append(message if message is not None and kind.startswith("SEND") else None)
    return RankProgram(
        actions=tuple(actions), texts=tuple(str(a) for a in actions), messages=tuple(messages),
        receives=tuple(receives), weight_order=tuple(a for a in actions if a.kind == "W"), deferred=deferred,
        overtaken=_overtaken(planned, actions),
    )


def _overtaken(planned: Sequence[Action], actions: Sequence[Action]) -> dict[tuple[str, int, int], frozenset[Action]]:
    """For each message a computation of `actions` waits for, the W that `planned` runs before
    that computation and `actions` after it."""
    before = {a: i for i, a in enumerate(planned)}
    now = {a: i for i, a in enumerate(actions)}
    weights = [a for a in actions if a.kind == "W"]
    result = {}
    for a in actions:
        if a.kind in ("F", "I", "B"):
            late = frozenset(w for w in weights if before[w] < before[a] and now[w] > now[a])
            if late:
                result[(ACTIVATIONS if a.kind == "F" else GRADIENTS, a.stage, a.microbatch)] = late
    return result


def defer_weights(actions: Sequence[Action], memory: MemoryModel) -> tuple[tuple[Action, ...], tuple[str, ...]]:
    """`actions` (one rank's lowered list) with the W that the plan runs between two sends moved,
    in order, to just after the second send; returns the list and the W that moved. Where the
    rank's activation memory (the simulator's model) would then exceed the list's own peak, or a
    stage's gradients be added out of microbatch order, only the latest of them move, as many as fit."""
    peak = _peak(actions, memory, 0.0)[0]
    out: list[Action] = []
    moved: list[str] = []
    segment: list[Action] = []
    level = 0.0
    for a in actions:
        segment.append(a)
        if not a.kind.startswith("SEND"):
            continue
        weights = [w for w in segment if w.kind == "W"]
        for count in range(len(weights), 0, -1):  # the latest `count` W go after the send
            late = weights[len(weights) - count :]
            arranged = [b for b in segment if b not in late] + late
            if gradients_in_order(arranged) and _peak(arranged, memory, level)[0] <= peak * (1 + 1e-9):
                segment, moved = arranged, moved + [str(w) for w in late]
                break
        out += segment
        level = _peak(segment, memory, level)[1]
        segment = []
    return tuple(out + segment), tuple(moved)


def _peak(actions: Sequence[Action], memory: MemoryModel, level: float) -> tuple[float, float]:
    """(highest activation memory while `actions` run from `level`, the level after them)."""
    peak = level
    for a in actions:
        peak = max(peak, level + memory.memory_rise(a.stage, a.kind))
        level += memory.memory_delta(a.stage, a.kind)
    return peak, level
