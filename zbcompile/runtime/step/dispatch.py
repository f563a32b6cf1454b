"""The one interpreter of a pipeline step, whatever carries the messages: it follows a program
(`runtime/step/rank_program.py`: compute actions F, I, W, B and the SEND/RECV between ranks; for
evaluation F and its messages alone) and runs each action by the handler of its kind, what the
computations take and leave kept in a `readiness.Mailbox`. Both runners drive it: one rank's
program over point-to-point messages, or every rank's in one process (`runtime/step/runner.py`).

Nothing in a step waits for the device: each action's interval is measured by an `ActionClock`
(`runtime/step/action_clock.py`: host time on CPU, events on the compute stream on CUDA, read at the
end of the step), and a computation waits only for the messages it consumes (the transport's
`wait`, which on NCCL makes the compute stream wait for that receive, not the host)."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from zbcompile.runtime.step.action_clock import ActionClock, HostClock
from zbcompile.runtime.step.action_pace import ActionPace
from zbcompile.runtime.step.rank_program import RankProgram
from zbcompile.runtime.step.readiness import Batch, Mailbox, Values
from zbcompile.runtime.step.stage import StageExecutor
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Action, ActionKind, Schedule


class Interpreter:
    """Runs `program` (set by `load`) on `executors` (the stages this process holds, by stage
    index; `copies`: a mirrored schedule's second copy of stages this process also holds, which
    run its microbatches from `Schedule.mirrored_from` on) step after step, its values in `mail`
    (`receive_device`; `follow_readiness`, read by `load`: see `Mailbox`). After a step,
    `timeline` holds (action, start, end) in `time.perf_counter()` seconds for every compute
    action, from when its data had arrived to when it finished, as `clock` measured it (default
    `HostClock`; on CUDA an `EventClock`), `comm_timeline` the same for every SEND (posting it)
    and RECV (the wait for its data, when a computation needs it), `early_w` the W run in a wait.
    `step_timeout_s` bounds the wait for the device at the end of a step."""

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
        self.follow_readiness = follow_readiness
        self.clock = clock if clock is not None else HostClock()
        self.step_timeout_s = step_timeout_s
        self.mail = mail = Mailbox(transport, receive_device, self.clock, self._run_weight)
        self.handlers: dict[ActionKind, Callable[[int, Action], None]] = {
            ActionKind.F: self._forward, ActionKind.I: self._backward, ActionKind.B: self._backward,
            ActionKind.W: self._weight, ActionKind.SEND_F: mail.send, ActionKind.SEND_B: mail.send,
            ActionKind.RECV_F: mail.receive, ActionKind.RECV_B: mail.receive,
        }
        self.timeline: list[tuple[str, float, float]] = []
        self.comm_timeline: list[tuple[str, float, float]] = []
        self.early_w: tuple[str, ...] = ()
        # testing and rehearsal aids (`runtime/step/action_pace.py`): how long each computation waits after it ran
        self.pace: ActionPace | None = None
        # called with the stage after every W and B (the actions that accumulate parameter gradients)
        self.grads_accumulated: Callable[[int], None] = lambda stage: None

    def load(self, program: RankProgram, schedule: Schedule) -> None:
        """Follow `program` (this process's part of `schedule`) from the next step on."""
        self.program = program
        self.mirrored_from = schedule.mirrored_from
        self.last = schedule.stages - 1
        self.early_w = ()
        self.mail.load(program, self.last, self.follow_readiness)

    def step(self, inputs: Batch, targets: Batch, loss_tangent: float | None = None) -> list[Values] | None:
        """One step over `len(inputs)` microbatches; returns what the last stage's F returned
        (`{"loss": ...}` in training) for the microbatches this process ran it for, in microbatch
        order, where it holds the last stage (else None). `loss_tangent`: the gradient each
        microbatch's loss gets (None: 1/m). Parameter gradients stay in the executors."""
        mail = self.mail
        mail.start_step(inputs, targets, 1.0 / len(inputs) if loss_tangent is None else loss_tangent)
        self.clock.start_step()
        handlers, post_ahead = self.handlers, mail.receives.post_ahead
        for index, action in enumerate(self.program.actions):
            post_ahead(index)
            handlers[action.kind](index, action)
        self.transport.complete_messages()
        intervals = self.clock.end_step(self.step_timeout_s)
        self.timeline, self.comm_timeline, self.early_w = intervals["compute"], intervals["comm"], tuple(mail.early)
        mail.forecast.end_step(self.timeline, intervals["wait"])
        results = mail.end_step()
        return results if self.last in self.executors else None

    # --- handlers of the compute actions: (position in the program, action) -----------------

    def _forward(self, index: int, action: Action) -> None:
        s, k = action.stage, action.microbatch
        text = self.program.texts[index]
        feed = self.mail.activations(s, k, text)
        started = self.clock.mark()
        self.mail.forward_made(s, k, self._executor(s, k).forward(k, feed))
        self._ran(action, text, started)

    def _backward(self, index: int, action: Action) -> None:
        """I or B: takes the gradients of the stage's outputs, hands those of its inputs to the
        previous stage; after I the microbatch's W may run, after B the stage's gradients are in."""
        s, k = action.stage, action.microbatch
        text = self.program.texts[index]
        grads_in = self.mail.gradients(s, k, text)
        executor, split = self._executor(s, k), action.kind == "I"
        started = self.clock.mark()
        self.mail.backward_made(s, k, (executor.input_backward if split else executor.backward)(k, grads_in))
        self._ran(action, text, started)
        if split:
            self.mail.weights.backward_done.add((s, k))
        else:
            self.grads_accumulated(s)

    def _weight(self, index: int, action: Action) -> None:
        if self.mail.weights.planned():  # else it ran early, in a wait
            self._run_weight(action, self.program.texts[index])

    def _executor(self, stage: int, microbatch: int) -> StageExecutor:
        """The copy of `stage` that runs `microbatch`."""
        if self.copies and self.mirrored_from is not None and microbatch >= self.mirrored_from:
            return self.copies[stage]
        return self.executors[stage]

    def _run_weight(self, action: Action, text: str) -> None:
        started = self.clock.mark()
        self._executor(action.stage, action.microbatch).weight_backward(action.microbatch)
        self._ran(action, text, started)
        self.grads_accumulated(action.stage)

    def _ran(self, action: Action, text: str, started) -> None:
        if self.pace is not None and self.clock.on_host:
            self.pace.wait(action, self.clock.seconds_since(started))
        self.clock.record("compute", text, started)
