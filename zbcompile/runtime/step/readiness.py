"""A rank's values between its actions (`Mailbox`), and following readiness: what the interpreter
(`runtime/step/dispatch.py`) keeps to bend the plan where no other rank can lose by it. When a
computation's message has not arrived yet, the next W (in the program's W order, once its I has
run: `WeightQueue`) runs in the meantime where the plan ran that W before this computation anyway
(`RankProgram.overtaken`), or where it is expected to fit in the wait: the same message was at
least that late in recent steps (`WaitForecast`). So a late message costs no more than the plan.
`ReceivesAhead` posts a step's receives ahead of the action list."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from typing import Any, Callable, Mapping, Sequence

import torch

from zbcompile.passes.shape_symbols import ShapeSymbols, is_symbolic, sizes_of
from zbcompile.runtime.step.action_clock import ActionClock
from zbcompile.runtime.step.rank_program import ACTIVATIONS, GRADIENTS, RankProgram, Receive
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Action

Values = dict[str, torch.Tensor]
Key = tuple[str, int, int]  # a message's (what it carries, receiving stage, microbatch)
Batch = Sequence[Mapping[str, torch.Tensor]]  # by microbatch, values by name


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
        if not recent or not self.weight_seconds:
            return False
        return statistics.median(recent) >= min(self.weight_seconds.values())

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
        self.backward_done: set[tuple[int, int]] = set()  # (stage, microbatch) of the I run so far

    def runnable(self) -> Action | None:
        """The next W, if it may run now."""
        w = self.order[self.next] if self.next < len(self.order) else None
        return w if w is not None and (w.stage, w.microbatch) in self.backward_done else None

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
        self, program: RankProgram, transport: MessageTransport, device: torch.device | None,
        watch: Callable[[Key], bool], shape: Callable[[Any, int], Any] = lambda shape, microbatch: shape,
    ) -> None:
        self.shape = shape  # a layout's shape for a microbatch (a shape-generic compile's at the step's sizes)
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
            microbatch = message.key[2]
            buffers = [
                torch.empty(self.shape(shape, microbatch), dtype=dtype, device=device)
                for shape, dtype in receive.layouts
            ]
        pending = self.transport.post_recv(buffers, message.peer, message.tag, message.text, self.watch(message.key))
        self.posted[message.key] = (receive, pending)
        self.next += 1


class Mailbox:
    """Where the computations of a program's steps take their values and leave what they make.
    F takes the microbatch's inputs (first stage) or the values that came from the previous
    stage (and the targets on the `last` stage); I and B take the gradient of the step's loss
    with respect to the microbatch's loss (last stage: `loss_tangent`, 1/m for the mean of the
    microbatch losses, see `runtime/parallel/batch_loss.py`) or the gradients that came from the
    next stage. What F, I and B hand a stage on this rank stays here until that stage takes it;
    what they hand another rank waits for the program's SEND. Receives are posted ahead
    (`ReceivesAhead`, buffers on `receive_device`) and waited for only when a computation needs
    their data, `run_weight(action, text)` running W meanwhile where `follow_readiness`."""

    def __init__(
        self, transport: MessageTransport, receive_device: torch.device | None, clock: ActionClock,
        run_weight: Callable[[Action, str], None],
    ) -> None:
        self.transport, self.receive_device, self.clock, self.run_weight = transport, receive_device, clock, run_weight
        self.symbols: ShapeSymbols | None = None  # a shape-generic compile's: message shapes follow each step's sizes

    def load(self, program: RankProgram, last: int, follow_readiness: bool) -> None:
        """Serve `program` from the next step on."""
        self.program, self.last, self.follow_readiness = program, last, follow_readiness
        self.forecast = WaitForecast()
        self.sent = frozenset(m.key for m in program.messages if m is not None)  # what leaves the rank

    def start_step(self, inputs: Batch, targets: Batch, loss_tangent: float) -> None:
        self.inputs, self.targets, self.loss_tangent = inputs, targets, loss_tangent
        self.results: dict[int, Values] = {}  # what the last stage's F returned
        self.held: dict[Key, Values] = {}  # for a stage on this rank, until it takes them
        self.outgoing: dict[Key, Values] = {}  # for another rank, until their SEND
        self.receives = ReceivesAhead(self.program, self.transport, self.receive_device, self._watch, self._shape)
        self.weights = WeightQueue(self.program.weight_order)
        self.early: list[str] = []  # the W run in a wait

    def _shape(self, shape: Any, microbatch: int) -> Any:
        """A message value's shape in `microbatch` (symbolic sizes at the microbatch's)."""
        if self.symbols is None or not is_symbolic(shape):
            return shape
        return self.symbols.shape(shape, self.symbols.values(sizes_of(self.inputs[microbatch])))

    def end_step(self) -> list[Values]:
        """The last stage's results of the step, in microbatch order; the step's values let go."""
        results = [self.results[k] for k in sorted(self.results)]
        self.inputs = self.targets = ()
        self.results, self.held, self.outgoing = {}, {}, {}
        return results

    def activations(self, stage: int, microbatch: int, text: str) -> Values:
        """What F (`text`) of `stage` takes for `microbatch`."""
        feed = dict(self.inputs[microbatch]) if stage == 0 else self.take((ACTIVATIONS, stage, microbatch), text)
        if stage and self.symbols is not None:  # a shape-generic compile: every stage reads the sizes
            feed.update(sizes_of(self.inputs[microbatch]))
        if stage == self.last:
            feed.update(self.targets[microbatch])
        return feed

    def forward_made(self, stage: int, microbatch: int, outputs: Values) -> None:
        if stage == self.last:
            self.results[microbatch] = outputs
        else:
            key = (ACTIVATIONS, stage + 1, microbatch)
            (self.outgoing if key in self.sent else self.held)[key] = outputs

    def gradients(self, stage: int, microbatch: int, text: str) -> Values:
        """What I or B (`text`) of `stage` takes for `microbatch`; the loss's in its dtype."""
        if stage == self.last:
            loss = self.results[microbatch]["loss"]
            return {"loss": torch.full((), self.loss_tangent, dtype=loss.dtype, device=loss.device)}
        return self.take((GRADIENTS, stage, microbatch), text)

    def backward_made(self, stage: int, microbatch: int, grads: Values) -> None:
        if stage > 0:
            key = (GRADIENTS, stage - 1, microbatch)
            (self.outgoing if key in self.sent else self.held)[key] = grads

    def take(self, key: Key, waiting_action: str) -> Values:
        """The values message `key` carries to the computation `waiting_action`: kept here, or
        received (running W meanwhile where readiness is followed)."""
        held = self.held
        if key in held:
            return held.pop(key)
        receive, pending = self.receives.take(key)
        transport, clock = self.transport, self.clock
        reached = clock.mark()
        if self.follow_readiness and transport.can_tell(pending):  # W while the message is on its way
            weights, forecast, overtaken = self.weights, self.forecast, self.program.overtaken
            queued = 0.0  # seconds of W queued here (where the host cannot see the device's time)

            def waited() -> float:
                return clock.seconds_since(reached) if clock.on_host else queued

            while (
                (w := weights.runnable()) is not None
                and (w in overtaken.get(key, ()) or forecast.fits(key, waited(), w.stage))
                and not transport.arrived(pending)
            ):
                weights.next += 1
                self.run_weight(w, str(w))
                self.early.append(str(w))
                queued += forecast.weight_seconds.get(w.stage, 0.0)
        wait_started = clock.mark()
        values = dict(zip(receive.message.names, transport.wait(pending, waiting_action)))
        clock.record("comm", receive.message.text, wait_started)
        clock.record("wait", key, reached, transport.arrival_time(pending) if clock.on_host else None)
        return values

    def _watch(self, key: Key) -> bool:
        """Whether the transport should tell when message `key` arrives: readiness asks only
        where a W may run in its wait."""
        overtaken, weights = self.program.overtaken, self.program.weight_order
        return self.follow_readiness and (key in overtaken or (bool(weights) and self.forecast.worth_watching(key)))

    def send(self, index: int, action: Action) -> None:
        message = self.program.messages[index]
        started = self.clock.mark()
        values = self.outgoing.pop(message.key)
        self.transport.send([values[n] for n in message.names], message.peer, message.tag, message.text)
        self.clock.record("comm", message.text, started)

    def receive(self, index: int, action: Action) -> None:
        self.receives.post_through(index)
