"""`Runner`: what runs a compiled pipeline's steps on the stages this process holds. Both
runners have its shape and drive the one interpreter (`runtime/step/dispatch.py`): `LocalRunner`
(`runtime/step/local.py`) every stage in one process over an in-process transport,
`DistributedRunner` (`runtime/step/distributed.py`) one rank's stages over point-to-point messages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

import torch

from zbcompile.compiler import CompiledPipeline
from zbcompile.passes.shape_symbols import sizes_of
from zbcompile.runtime.parallel import batch, batch_loss
from zbcompile.runtime.step.action_clock import ActionClock
from zbcompile.runtime.step.dispatch import Interpreter
from zbcompile.runtime.step.rank_program import ACTIVATIONS, RankProgram
from zbcompile.runtime.step.stage import StageExecutor, accumulate_grads, merge_stage_grads
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Action, Schedule


class Runner(ABC):
    """Runs `compiled`'s stages held here (`executors`: stage -> StageExecutor, `local_stages`
    in order; `copies`: a mirrored schedule's second copy of stages held here too, where one
    process runs both copies) step after step, following `schedule` until `reschedule()`.
    `layout` is this rank's place among the pipelines (`layout.Layout`; None in one
    process)."""

    layout: Any = None

    def __init__(
        self,
        compiled: CompiledPipeline,
        schedule: Schedule,
        executors: dict[int, StageExecutor],
        transport: MessageTransport,
        receive_device: torch.device | None,
        follow_readiness: bool,
        clock: ActionClock | None,
        copies: dict[int, StageExecutor] | None = None,
    ) -> None:
        self.compiled = compiled
        self.executors = executors
        self.local_stages = sorted(executors)
        self.transport = transport
        self.follow_readiness = follow_readiness
        self.interpreter = Interpreter(executors, transport, receive_device, follow_readiness, clock, copies)
        self.interpreter.mail.symbols = compiled.traced.symbols
        self.sizes: dict[Any, int] = {}  # a shape-generic compile's: the latest step's symbol values
        self._load(schedule)

    @property
    def copies(self) -> dict[int, StageExecutor]:
        """A mirrored schedule's second copy of stages held here (the interpreter's)."""
        return self.interpreter.copies

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    def reschedule(self, schedule: Schedule) -> None:
        """Run `schedule` from the next step on."""
        self._load(schedule)

    def follow(self, readiness: bool) -> None:
        """From the next step on, follow readiness (W run in waits and past sends) or keep the
        plan's order (`runtime/step/dispatch.py`)."""
        if readiness != self.follow_readiness:
            self.follow_readiness = self.interpreter.follow_readiness = readiness
            self._load(self._schedule)

    def use_programs(self, compiled: CompiledPipeline) -> None:
        """Run `compiled`'s stage programs from the next step on: the same stages, cut and
        messages, other programs (recompute="auto"'s levels chosen again). Between steps only."""
        if compiled is self.compiled:
            return
        for executors in (self.executors, self.copies):
            for stage, executor in executors.items():
                executors[stage] = executor.running(compiled.programs[stage])
        self.compiled = compiled
        self._load(self._schedule)

    def _load(self, schedule: Schedule) -> None:
        _check_copies(schedule, self.compiled)
        self._schedule = schedule
        self.interpreter.load(self._program(schedule), schedule)

    @abstractmethod
    def _program(self, schedule: Schedule) -> RankProgram:
        """What this process runs of `schedule` in a step."""

    @abstractmethod
    def reduce_grads(self) -> dict[str, torch.Tensor]:
        """The step's parameter gradients this process holds, by FQN."""

    def step(
        self, inputs: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]],
        loss_tangent: float | None = None,
    ) -> list[torch.Tensor] | None:
        """One step; returns the microbatch losses where this process holds the last stage, else
        None. `loss_tangent`: the gradient each microbatch loss gets (None: 1/m, the mean's;
        `runtime/parallel/batch_loss.py`). Parameter gradients stay in the executors until `reduce_grads()`."""
        results = self.interpreter.step(inputs, targets, loss_tangent)
        return [r["loss"] for r in results] if results is not None else None

    def train(
        self, micro_inputs: list, micro_targets: list, absent: tuple[str, ...], ownership: Any,
        before: Sequence[Callable[[], None]] = (),
    ) -> torch.Tensor | None:
        """One training step over a batch split into microbatches (`batch.split`; `absent`: the
        parts this rank was not given, `batch.LocalBatch`): refused where a stage held here reads
        an absent part or an unfilled parameter; computed with the module's current tensors
        (`ownership`: its `state_ownership.StateOwnership`); run after the hooks `before`; its
        gradients reduced and added to the module's `.grad`. Returns the step's loss
        (`batch_loss`; None where this process does not hold the last stage)."""
        stages = self.schedule.stages
        feeds, targets = batch.fed(self, micro_inputs, micro_targets, absent, ownership, stages)
        symbols = self.compiled.traced.symbols
        self.sizes = symbols.values(sizes_of(feeds[0])) if symbols is not None else {}
        reduction = batch_loss.reduction(
            self.compiled.traced, micro_inputs, feeds, targets, ownership.module, self.executors, stages, self.layout
        )
        for hook in before:
            hook()
        losses = self.step(feeds, targets, reduction.tangent)
        accumulate_grads(ownership.module, self.reduce_grads())
        return reduction.loss(losses)

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Parameters and buffers (`param:<fqn>`, `buffer:<fqn>`) the next step computes with."""
        for executor in self._all_executors():
            executor.state = state

    def _message_names(self, carries: str, stage: int) -> Sequence[str]:
        """The values a message of `carries` (ACTIVATIONS or GRADIENTS) into `stage` holds."""
        if carries == ACTIVATIONS:
            return self.compiled.partition.stages[stage].inputs
        return self.compiled.programs[stage].joint.output_grads

    def _value_layout(self, name: str) -> tuple[torch.Size, torch.dtype]:
        value = self.compiled.partition.values[name]
        return value.shape, value.dtype

    def _stage_grads(self) -> dict[str, torch.Tensor]:
        """The step's gradients of the stages held here, summed in stage order."""
        return merge_stage_grads([self.executors[s] for s in self.local_stages])

    @property
    def program(self) -> RankProgram:
        return self.interpreter.program

    @property
    def actions(self) -> tuple[Action, ...]:
        """The action list as it runs (the lowered schedule; W deferred past sends where readiness
        is followed)."""
        return self.interpreter.program.actions

    @property
    def timeline(self) -> list[tuple[str, float, float]]:
        """(action, start, end) of every compute action of the last step (`Interpreter`)."""
        return self.interpreter.timeline

    @property
    def comm_timeline(self) -> list[tuple[str, float, float]]:
        """SEND posts and RECV waits of the last step, the same way."""
        return self.interpreter.comm_timeline

    @property
    def moved_w(self) -> dict[str, tuple[str, ...]]:
        """W that ran elsewhere than the plan put them in the last step: "past_send", after a
        send the plan ran them before (the same every step of a schedule), and "into_wait", run
        early while a computation waited for a message."""
        return {"past_send": self.interpreter.program.deferred, "into_wait": self.interpreter.early_w}

    @property
    def peak_live_bytes(self) -> int:
        """The highest bytes each held stage's microbatches kept alive, summed over those stages."""
        return sum(e.memory.peak_live_bytes for e in self._all_executors())

    @property
    def peak_activation_bytes(self) -> int:
        """The same with what lives inside each action (`ActivationCount.peak_activation_bytes`),
        counted while `measure_transients(True)`; 0 otherwise."""
        return sum(e.memory.peak_activation_bytes for e in self._all_executors())

    def measure_transients(self, on: bool = True) -> None:
        """Count, from the next action on, the memory alive inside each action of every held stage
        (off by default: it traces every op; see `ActivationCount`)."""
        for executor in self._all_executors():
            executor.memory.measure_transients = on

    def reset_peaks(self) -> None:
        """Start the peak counts of every held stage afresh (e.g. after a warm-up step)."""
        for executor in self._all_executors():
            executor.memory.reset_peaks()

    def _all_executors(self) -> list:
        """Every executor this process runs: one per held stage, and a mirrored schedule's second copies."""
        return [*self.executors.values(), *self.copies.values()]


def _check_copies(schedule: Schedule, compiled: CompiledPipeline) -> None:
    """A mirrored schedule (dualpipe) runs each stage's F in two copies, each for its share of
    the microbatches; buffers that F updates (BatchNorm's running statistics) would then not see
    the microbatches in order, nor stay equal in both copies: refused."""
    if schedule.mirrored_from is None:
        return
    for stage in compiled.partition.stages:
        if stage.buffer_updates:
            raise ValueError(
                f"schedule {schedule.name!r} runs every stage in two copies of the pipeline, each for part of the "
                f"microbatches, but stage {stage.index} updates buffers in its forward "
                f"({', '.join(stage.buffer_updates[:3])}), "
                "which need every microbatch in order; use a schedule with one copy, such as dualpipev or zbv"
            )
