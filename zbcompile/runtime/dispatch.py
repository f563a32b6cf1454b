"""The one interpreter of a pipeline step, whatever carries the messages: it follows a program
(`runtime/program.py`: compute actions F, I, W, B and the SEND/RECV between ranks) and runs each
action by the handler of its kind (`Interpreter.handlers`). Both runners drive it: one rank's
program over point-to-point messages, or every rank's in one process over an in-process
transport (`runtime/runner.py`).

F takes the microbatch's inputs (first stage) or the values that came from the previous stage
(and the targets on the last stage); I and B take the gradient of the mean loss (last stage) or
the gradients that came from the next stage; W takes nothing. What F, I and B produce for a
stage on the same rank stays here until that stage takes it; for another rank it waits for the
SEND that follows. Receives are posted ahead (`readiness.ReceivesAhead`) and waited for only
when a computation needs their data.

Following readiness (`follow_readiness`): when a computation's message has not arrived yet,
the next W (in the program's W order, once its I has run) runs in the meantime where the plan
ran that W before this computation anyway, or where it is expected to fit in the wait: the same
message was at least that late in recent steps (`readiness.WaitForecast`). So a late message
costs no more than the plan."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from zbcompile.runtime.p2p import MessageTransport
from zbcompile.runtime.program import RankProgram
from zbcompile.runtime.readiness import ReceivesAhead, WaitForecast, WeightQueue
from zbcompile.runtime.stage import StageExecutor, mean_grad
from zbcompile.schedules import Action, Schedule

Values = dict[str, torch.Tensor]
Key = tuple[str, int, int]  # a message's (direction, receiving stage, microbatch)
clock = time.perf_counter


class Interpreter:
    """Runs `program` (set by `load`) on `executors` (the stages this process holds, by stage
    index; `copies`: a mirrored schedule's second copy of stages this process also holds, which
    run its microbatches from `Schedule.mirrored_from` on) step after step. After a step,
    `timeline` holds (action, start, end) in `time.perf_counter()` seconds for every compute
    action, from when its data had arrived to when it finished (after `synchronize()`, where
    given), `comm_timeline` the same for every SEND (posting it) and RECV (the wait for its data,
    when a computation needs it), `early_w` the W run in a wait. Receive buffers are made on
    `receive_device` (None: the transport hands the sent tensors over)."""

    def __init__(
        self,
        executors: Mapping[int, StageExecutor],
        transport: MessageTransport,
        receive_device: torch.device | None,
        follow_readiness: bool,
        synchronize: Callable[[], None] | None,
        copies: Mapping[int, StageExecutor] | None = None,
    ) -> None:
        self.executors = executors
        self.copies = copies if copies is not None else {}
        self.transport = transport
        self.receive_device = receive_device
        self.follow_readiness = follow_readiness
        self.synchronize = synchronize or _nothing
        self.handlers: dict[str, Callable[[int, Action], None]] = {
            "F": self._forward,
            "I": self._input_backward,
            "B": self._backward,
            "W": self._weight,
            "SEND_F": self._send,
            "SEND_B": self._send,
            "RECV_F": self._receive,
            "RECV_B": self._receive,
        }
        self.timeline: list[tuple[str, float, float]] = []
        self.comm_timeline: list[tuple[str, float, float]] = []
        self.early_w: tuple[str, ...] = ()
        # called with the stage after every W and B (the actions that accumulate parameter gradients)
        self.grads_accumulated: Callable[[int], None] = _ignore

    def load(self, program: RankProgram, schedule: Schedule) -> None:
        """Follow `program` (this process's part of `schedule`) from the next step on."""
        stage_to_rank = schedule.stage_to_rank
        self.program = program
        self.mirrored_from = schedule.mirrored_from
        self.last = len(stage_to_rank) - 1
        # per stage: whether what its F (its I or B) hands the next (previous) stage leaves the rank
        self.forward_sent = tuple(s < self.last and stage_to_rank[s + 1] != r for s, r in enumerate(stage_to_rank))
        self.backward_sent = tuple(s > 0 and stage_to_rank[s - 1] != r for s, r in enumerate(stage_to_rank))
        self.early_w = ()
        self.forecast = WaitForecast()

    def step(self, inputs: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """One step over `len(inputs)` microbatches; returns the losses of the microbatches this
        process ran the last stage for, in microbatch order, where it holds the last stage (else
        None). Parameter gradients stay in the executors."""
        program = self.program
        self.inputs, self.targets = inputs, targets
        self.losses: dict[int, torch.Tensor] = {}
        self.held: dict[Key, Values] = {}  # for a stage on this rank, until it takes them
        self.outgoing: dict[Key, Values] = {}  # for another rank, until their SEND
        self.receives = ReceivesAhead(program, self.transport, self.receive_device, self._watch)
        self.weights = WeightQueue(program.weight_order)
        self._timeline: list[tuple[str, float, float]] = []
        self._comm_timeline: list[tuple[str, float, float]] = []
        self._early: list[str] = []
        handlers, post_ahead = self.handlers, self.receives.post_ahead
        for index, action in enumerate(program.actions):
            post_ahead(index)
            handlers[action.kind](index, action)
        self.transport.flush_sends()
        self.forecast.end_step()
        self.timeline, self.comm_timeline, self.early_w = self._timeline, self._comm_timeline, tuple(self._early)
        losses = [self.losses[k] for k in sorted(self.losses)] if self.last in self.executors else None
        self.inputs = self.targets = ()
        self.losses, self.held, self.outgoing = {}, {}, {}
        return losses

    # --- handlers: (position in the program, action) ---------------------------------------

    def _forward(self, index: int, action: Action) -> None:
        s, k = action.stage, action.microbatch
        text = self.program.texts[index]
        feed = dict(self.inputs[k]) if s == 0 else self._fetch(("F", s, k), text)
        if s == self.last:
            feed.update(self.targets[k])
        started = clock()
        outputs = self._executor(s, k).forward(k, feed)
        if s == self.last:
            self.losses[k] = outputs["loss"]
        else:
            (self.outgoing if self.forward_sent[s] else self.held)[("F", s + 1, k)] = outputs
        self._ran(text, started)

    def _input_backward(self, index: int, action: Action) -> None:
        self._run_backward(index, action, self._executor(action.stage, action.microbatch).input_backward)
        self.weights.backward_ran(action)

    def _backward(self, index: int, action: Action) -> None:
        self._run_backward(index, action, self._executor(action.stage, action.microbatch).backward)
        self.grads_accumulated(action.stage)

    def _weight(self, index: int, action: Action) -> None:
        if self.weights.planned():  # else it ran early, in a wait
            self._run_weight(action, self.program.texts[index])

    def _send(self, index: int, action: Action) -> None:
        message = self.program.messages[index]
        started = clock()
        values = self.outgoing.pop(message.key)
        self.transport.send([values[n] for n in message.names], message.peer, message.tag, message.text)
        self._comm_timeline.append((message.text, started, clock()))

    def _receive(self, index: int, action: Action) -> None:
        self.receives.post_through(index)

    # --- what the handlers share -----------------------------------------------------------

    def _executor(self, stage: int, microbatch: int) -> StageExecutor:
        """The copy of `stage` that runs `microbatch`."""
        if self.copies and self.mirrored_from is not None and microbatch >= self.mirrored_from:
            return self.copies[stage]
        return self.executors[stage]

    def _run_backward(self, index: int, action: Action, compute: Callable[[int, Values], Values]) -> None:
        """I or B (`compute`): takes the gradients of the stage's outputs, hands those of its
        inputs to the previous stage."""
        s, k = action.stage, action.microbatch
        text = self.program.texts[index]
        if s == self.last:
            grads_in = {"loss": mean_grad(self.losses[k], len(self.inputs))}
        else:
            grads_in = self._fetch(("B", s, k), text)
        started = clock()
        grads_out = compute(k, grads_in)
        if s > 0:
            (self.outgoing if self.backward_sent[s] else self.held)[("B", s - 1, k)] = grads_out
        self._ran(text, started)

    def _run_weight(self, action: Action, text: str) -> None:
        started = clock()
        self._executor(action.stage, action.microbatch).weight_backward(action.microbatch)
        self.synchronize()
        ended = clock()
        self._timeline.append((text, started, ended))
        self.forecast.note_weight(action.stage, ended - started)
        self.grads_accumulated(action.stage)

    def _ran(self, text: str, started: float) -> None:
        self.synchronize()
        self._timeline.append((text, started, clock()))

    def _fetch(self, key: Key, waiting_action: str) -> Values:
        """The values message `key` carries to the computation `waiting_action`: kept here, or
        received (running W meanwhile where readiness is followed)."""
        held = self.held
        if key in held:
            return held.pop(key)
        receive, pending = self.receives.take(key)
        transport = self.transport
        reached = clock()
        if self.follow_readiness and transport.can_tell(pending):  # W while the message is on its way
            weights, forecast, overtaken = self.weights, self.forecast, self.program.overtaken
            while (
                (w := weights.runnable()) is not None
                and (w in overtaken.get(key, ()) or forecast.fits(key, clock() - reached, w.stage))
                and not transport.arrived(pending)
            ):
                weights.advance()
                self._run_weight(w, str(w))
                self._early.append(str(w))
        waited = clock()
        values = dict(zip(receive.message.names, transport.wait(pending, waiting_action)))
        done = clock()
        self._comm_timeline.append((receive.message.text, waited, done))
        self.forecast.note_wait(key, (transport.arrival_time(pending) or done) - reached)
        return values

    def _watch(self, key: Key) -> bool:
        """Whether the transport should tell when message `key` arrives: readiness asks only
        where a W may run in its wait."""
        program = self.program
        return self.follow_readiness and (key in program.overtaken or (bool(program.weight_order) and self.forecast.worth_watching(key)))


def _nothing() -> None:
    pass


def _ignore(stage: int) -> None:
    pass
