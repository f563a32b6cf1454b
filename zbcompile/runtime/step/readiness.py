"""Following readiness: what the interpreter (`runtime/step/dispatch.py`) keeps to bend the plan
where no other rank can lose by it. `ReceivesAhead` posts a step's receives ahead of the action
list, `WeightQueue` says which W may run early, in a wait for a message, and `WaitForecast`
expects, from recent steps, whether a W fits in that wait."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from typing import Any, Callable, Sequence

import torch

from zbcompile.runtime.step.rank_program import RankProgram, Receive
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Action


class WaitForecast:
    """What a rank expects of its waits, from its recent steps: how late each message was (from
    when the computation that needs it was reached to its arrival; negative: it was there
    first) and how long each stage's W took. Steps of one schedule repeat, so a message late in
    the last steps is likely late again."""

    RECENT_STEPS = 3

    def __init__(self) -> None:
        self.lateness: dict[tuple[str, int, int], deque[float]] = defaultdict(lambda: deque(maxlen=self.RECENT_STEPS))
        self.weight_seconds: dict[int, float] = {}  # per stage, the median W of the last step
        self._weights: dict[int, list[float]] = defaultdict(list)  # this step's

    def worth_watching(self, key: tuple[str, int, int]) -> bool:
        """Whether the wait for message `key` may leave room for a W: it was late by at least
        the shortest W in recent steps."""
        recent = self.lateness.get(key)
        return (
            bool(recent)
            and bool(self.weight_seconds)
            and statistics.median(recent) >= min(self.weight_seconds.values())
        )

    def fits(self, key: tuple[str, int, int], waited: float, stage: int) -> bool:
        """Whether a W of `stage` should fit in the rest of the wait for message `key`, of which
        `waited` seconds have passed (the median lateness of its recent steps says so)."""
        recent = self.lateness.get(key)
        if not recent or stage not in self.weight_seconds:
            return False
        return waited + self.weight_seconds[stage] <= statistics.median(recent)

    def note_wait(self, key: tuple[str, int, int], lateness: float) -> None:
        self.lateness[key].append(lateness)

    def note_weight(self, stage: int, seconds: float) -> None:
        self._weights[stage].append(seconds)

    def end_step(
        self, timeline: Sequence[tuple[str, float, float]] = (), waits: Sequence[tuple[Any, float, float]] = ()
    ) -> None:
        """Close a step: take its W times from `timeline` ((action, start, end), the compute
        actions) and its messages' lateness from `waits` ((key, computation reached, message
        arrived)), besides those noted one by one."""
        for text, start, end in timeline:
            action = Action.parse(text)
            if action.kind == "W":
                self.note_weight(action.stage, end - start)
        for key, reached, arrived in waits:
            self.note_wait(key, arrived - reached)
        self.weight_seconds.update({stage: statistics.median(d) for stage, d in self._weights.items()})
        self._weights.clear()


class WeightQueue:
    """The W of a step in the order they must run (the program's); the next one may run early
    once its stage's I for that microbatch has run."""

    def __init__(self, order: Sequence[Action]) -> None:
        self.order = order
        self.next = 0  # W run so far
        self.reached = 0  # W the program's list has reached
        self.backward_done: set[tuple[int, int]] = set()

    def backward_ran(self, action: Action) -> None:
        self.backward_done.add((action.stage, action.microbatch))

    def runnable(self) -> Action | None:
        """The next W, if it may run now."""
        if self.next < len(self.order):
            w = self.order[self.next]
            if (w.stage, w.microbatch) in self.backward_done:
                return w
        return None

    def advance(self) -> None:
        self.next += 1

    def planned(self) -> bool:
        """The list reached its next W: True if it is still to run (it is then run), False if it
        already ran early."""
        self.reached += 1
        if self.reached <= self.next:
            return False
        self.next += 1
        return True


RECEIVE_LOOKAHEAD = 4
"""Receives a rank keeps posted ahead of its place in the action list. gloo hands a message over
only once its receive is posted (the send waits for it), so a receive posted just before the
computation that needs it puts a round trip on the critical path; posted ahead, the transfer
overlaps the computation before it. Each one holds a boundary-sized buffer."""


class ReceivesAhead:
    """One step's receives, posted in program order up to RECEIVE_LOOKAHEAD ahead of the action
    the rank is at, and always by the time the program reaches them. Where the transport matches
    messages by order rather than tag (every backend but gloo, NCCL among them), a receive is never
    posted before a send the program has before it, to any peer: NCCL runs a rank's point-to-point
    operations on one stream in the order they are posted, a receive holding up everything behind it
    until its sender sends, so the rank's operations keep the program's order, which the lowering
    proved free of deadlock (docs/runtime.md, "Posting order"). Where `watch(key)`, the transport
    can tell when a message has arrived. Receive buffers are made on `device`; None: the transport
    hands over the sent tensors themselves (in one process)."""

    def __init__(
        self,
        program: RankProgram,
        transport: MessageTransport,
        device: torch.device | None,
        watch: Callable[[tuple[str, int, int]], bool],
    ) -> None:
        self.plan = program.receives
        self.transport = transport
        self.device = device
        self.watch = watch
        self.in_order = not transport.matches_by_tag
        self.next = 0
        self.posted: dict[tuple[str, int, int], tuple[Receive, Any]] = {}

    def post_ahead(self, index: int) -> None:
        """The rank is about to run action `index` (every earlier one has run)."""
        while self.next < len(self.plan) and len(self.posted) < RECEIVE_LOOKAHEAD:
            if self.in_order and self.plan[self.next].after >= index:
                break
            self._post_next()

    def post_through(self, index: int) -> None:
        """Post every receive up to and including the one at action `index`."""
        while self.next < len(self.plan) and self.plan[self.next].index <= index:
            self._post_next()

    def take(self, key: tuple[str, int, int]) -> tuple[Receive, Any]:
        return self.posted.pop(key)

    def _post_next(self) -> None:
        receive = self.plan[self.next]
        message = receive.message
        buffers = []
        if self.device is not None:  # one tensor is received into; several lay out one flat buffer
            device = self.device if len(receive.layouts) == 1 else "meta"
            buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in receive.layouts]
        pending = self.transport.post_recv(
            buffers, message.peer, message.tag, message.text, watch=self.watch(message.key)
        )
        self.posted[message.key] = (receive, pending)
        self.next += 1
