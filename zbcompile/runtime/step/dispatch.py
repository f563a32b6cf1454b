"""The one interpreter of a pipeline step, whatever carries the messages: it follows a program
(`runtime/step/rank_program.py`: compute actions F, I, W, B and the SEND/RECV between ranks) and runs each
action by the handler of its kind (`Interpreter.handlers`). Both runners drive it: one rank's
program over point-to-point messages, or every rank's in one process over an in-process
transport (`runtime/step/runner.py`).

F takes the microbatch's inputs (first stage) or the values that came from the previous stage
(and the targets on the last stage); I and B take the gradient of the step's loss with respect
to the microbatch's loss (last stage: `loss_tangent`, 1/m for the mean of the microbatch losses,
see `runtime/parallel/batch_loss.py`) or the gradients that came from the next stage; W takes nothing.
A forward-only program (evaluation) has F and its messages alone. What F, I and B produce for a
stage on the same rank stays here until that stage takes it; for another rank it waits for the
SEND that follows. Receives are posted ahead (`readiness.ReceivesAhead`) and waited for only
when a computation needs their data.

Following readiness (`follow_readiness`): when a computation's message has not arrived yet,
the next W (in the program's W order, once its I has run) runs in the meantime where the plan
ran that W before this computation anyway, or where it is expected to fit in the wait: the same
message was at least that late in recent steps (`readiness.WaitForecast`). So a late message
costs no more than the plan.

Nothing in a step waits for the device: each action's interval is measured by an `ActionClock`
(`runtime/step/action_clock.py`: host time on CPU, events on the compute stream on CUDA, read at the
end of the step), and a computation waits only for the messages it consumes (the transport's
`wait`, which on NCCL makes the compute stream wait for that receive, not the host)."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from zbcompile.runtime.step.action_clock import ActionClock, HostClock
from zbcompile.runtime.step.action_pace import ActionPace
from zbcompile.runtime.step.rank_program import ACTIVATIONS, GRADIENTS, RankProgram
from zbcompile.runtime.step.readiness import ReceivesAhead, WaitForecast, WeightQueue
from zbcompile.runtime.step.stage import StageExecutor, loss_grad
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Action, ActionKind, Schedule

Values = dict[str, torch.Tensor]
Key = tuple[str, int, int]  # a message's (what it carries, receiving stage, microbatch)


class Interpreter:
    """Runs `program` (set by `load`) on `executors` (the stages this process holds, by stage
    index; `copies`: a mirrored schedule's second copy of stages this process also holds, which
    run its microbatches from `Schedule.mirrored_from` on) step after step. After a step,
    `timeline` holds (action, start, end) in `time.perf_counter()` seconds for every compute
    action, from when its data had arrived to when it finished, as `clock` measured it (default
    `HostClock`; on CUDA an `EventClock`), `comm_timeline` the same for every SEND (posting it)
    and RECV (the wait for its data, when a computation needs it), `early_w` the W run in a wait.
    Receive buffers are made on `receive_device` (None: the transport hands the sent tensors
    over). `step_timeout_s` bounds the wait for the device at the end of a step."""

    def __init__(
        self,
        executors: Mapping[int, StageExecutor],
        transport: MessageTransport,
        receive_device: torch.device | None,
        follow_readiness: bool,
        clock: ActionClock | None = None,
        copies: Mapping[int, StageExecutor] | None = None,
        step_timeout_s: float = 1800.0,
    ) -> None:
        self.executors = executors
        self.copies = copies if copies is not None else {}
        self.transport = transport
        self.receive_device = receive_device
        self.follow_readiness = follow_readiness
        self.clock = clock if clock is not None else HostClock()
        self.step_timeout_s = step_timeout_s
        self.handlers: dict[ActionKind, Callable[[int, Action], None]] = {
            ActionKind.F: self._forward,
            ActionKind.I: self._input_backward,
            ActionKind.B: self._backward,
            ActionKind.W: self._weight,
            ActionKind.SEND_F: self._send,
            ActionKind.SEND_B: self._send,
            ActionKind.RECV_F: self._receive,
            ActionKind.RECV_B: self._receive,
        }
        self.timeline: list[tuple[str, float, float]] = []
        self.comm_timeline: list[tuple[str, float, float]] = []
        self.early_w: tuple[str, ...] = ()
        # testing and rehearsal aids (`runtime/step/action_pace.py`): how long each computation waits after it ran
        self.pace: ActionPace | None = None
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

    def step(
        self,
        inputs: Sequence[Mapping[str, torch.Tensor]],
        targets: Sequence[Mapping[str, torch.Tensor]],
        loss_tangent: float | None = None,
    ) -> list[Values] | None:
        """One step over `len(inputs)` microbatches; returns what the last stage's F returned
        (`{"loss": ...}` in training) for the microbatches this process ran it for, in microbatch
        order, where it holds the last stage (else None). `loss_tangent`: the gradient each
        microbatch's loss gets (None: 1/m). Parameter gradients stay in the executors."""
        program = self.program
        self.inputs, self.targets = inputs, targets
        self.loss_tangent = 1.0 / len(inputs) if loss_tangent is None else loss_tangent
        self.results: dict[int, Values] = {}
        self.held: dict[Key, Values] = {}  # for a stage on this rank, until it takes them
        self.outgoing: dict[Key, Values] = {}  # for another rank, until their SEND
        self.receives = ReceivesAhead(program, self.transport, self.receive_device, self._watch)
        self.weights = WeightQueue(program.weight_order)
        self._early: list[str] = []
        self.clock.start_step()
        handlers, post_ahead = self.handlers, self.receives.post_ahead
        for index, action in enumerate(program.actions):
            post_ahead(index)
            handlers[action.kind](index, action)
        self.transport.complete_messages()
        intervals = self.clock.end_step(self.step_timeout_s)
        self.timeline, self.comm_timeline, self.early_w = intervals["compute"], intervals["comm"], tuple(self._early)
        self.forecast.end_step(self.timeline, intervals["wait"])
        results = [self.results[k] for k in sorted(self.results)] if self.last in self.executors else None
        self.inputs = self.targets = ()
        self.results, self.held, self.outgoing = {}, {}, {}
        return results

    # --- handlers: (position in the program, action) ---------------------------------------

    def _forward(self, index: int, action: Action) -> None:
        s, k = action.stage, action.microbatch
        text = self.program.texts[index]
        feed = dict(self.inputs[k]) if s == 0 else self._fetch((ACTIVATIONS, s, k), text)
        if s == self.last:
            feed.update(self.targets[k])
        started = self.clock.mark()
        outputs = self._executor(s, k).forward(k, feed)
        if s == self.last:
            self.results[k] = outputs
        else:
            (self.outgoing if self.forward_sent[s] else self.held)[(ACTIVATIONS, s + 1, k)] = outputs
        self._ran(action, text, started)

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
        started = self.clock.mark()
        values = self.outgoing.pop(message.key)
        self.transport.send([values[n] for n in message.names], message.peer, message.tag, message.text)
        self.clock.record("comm", message.text, started)

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
            grads_in = {"loss": loss_grad(self.results[k]["loss"], self.loss_tangent)}
        else:
            grads_in = self._fetch((GRADIENTS, s, k), text)
        started = self.clock.mark()
        grads_out = compute(k, grads_in)
        if s > 0:
            (self.outgoing if self.backward_sent[s] else self.held)[(GRADIENTS, s - 1, k)] = grads_out
        self._ran(action, text, started)

    def _run_weight(self, action: Action, text: str) -> None:
        started = self.clock.mark()
        self._executor(action.stage, action.microbatch).weight_backward(action.microbatch)
        self._ran(action, text, started)
        self.grads_accumulated(action.stage)

    def _ran(self, action: Action, text: str, started) -> None:
        if self.pace is not None and self.clock.on_host:
            self.pace.wait(action, self.clock.seconds_since(started))
        self.clock.record("compute", text, started)

    def _fetch(self, key: Key, waiting_action: str) -> Values:
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
                weights.advance()
                self._run_weight(w, str(w))
                self._early.append(str(w))
                queued += forecast.weight_seconds.get(w.stage, 0.0)
        waited = clock.mark()
        values = dict(zip(receive.message.names, transport.wait(pending, waiting_action)))
        clock.record("comm", receive.message.text, waited)
        clock.record("wait", key, reached, transport.arrival_time(pending) if clock.on_host else None)
        return values

    def _watch(self, key: Key) -> bool:
        """Whether the transport should tell when message `key` arrives: readiness asks only
        where a W may run in its wait."""
        program = self.program
        return self.follow_readiness and (
            key in program.overtaken or (bool(program.weight_order) and self.forecast.worth_watching(key))
        )


def _ignore(stage: int) -> None:
    pass
