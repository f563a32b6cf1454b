"""Evaluation: a forward-only compile (`compiler.compile_forward_only`) run over the forward-only
schedule (`schedules.forward_only`) by the one interpreter (`runtime/step/dispatch.py`), on the
stages this process holds and over the training runner's transport.

`ForwardStage` runs one stage's forward program for any microbatch and keeps nothing for a
backward: every value the stage took in or made is freed at its last use, so a rank holds only
the microbatches in flight. `ForwardRunner` runs a step of them and returns what the last
stage's F returned per microbatch.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from zbcompile.compiler import CompiledForward
from zbcompile.passes.partition import Stage
from zbcompile.passes.program import Program
from zbcompile.runtime.step.dispatch import Interpreter, Values
from zbcompile.runtime.step.live_memory import TransientTracker
from zbcompile.runtime.step.rank_program import rank_program, single_process_program
from zbcompile.runtime.step.stage import as_traced, forward_results, placeholder_layouts
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import forward_only
from zbcompile.value_names import input_name


class ForwardStage:
    """F of one stage (`program`, from `forward_program`) for any microbatch, on `state`'s
    parameters and buffers. Buffers the forward updates take their new values after each F.
    `peak_activation_bytes` counts, while `measure_transients`, the most bytes alive inside an
    F (what it took in and every storage it created; `ActivationCount`'s count, with no other
    microbatch holding anything)."""

    def __init__(self, program: Program, stage: Stage, state: Mapping[str, torch.Tensor]) -> None:
        self.program = program
        self.stage = stage
        self.state = state
        self.measure_transients = False
        self.peak_activation_bytes = 0
        self._relayed = {input_name(v) for v in stage.relays}
        self._reads = set(program.signature.inputs)
        self._layouts = placeholder_layouts(program)

    def forward(self, microbatch: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """F of `microbatch`: `inputs` by value name, taken (the dict is emptied, so that each
        value is freed at its last use; a value the stage neither reads nor relays, such as a
        batch input no stage reads, is dropped at once); returns the stage's outputs by value
        name (the last stage's results by their names: `loss`, or `output_<i>`)."""
        env = {
            input_name(n): as_traced(v, self._layouts.get(input_name(n)))
            for n, v in inputs.items()
            if input_name(n) in self._reads or input_name(n) in self._relayed
        }
        inputs.clear()
        consumed = [name for name in env if name not in self._relayed]
        if self.measure_transients:
            with TransientTracker() as tracker:
                tracker.take(env.values())
                self.program.run(env, self.state, consumed)
            self.peak_activation_bytes = max(self.peak_activation_bytes, tracker.peak)
        else:
            self.program.run(env, self.state, consumed)
        return forward_results(self.stage, self.program, env, self.state)


class ForwardRunner:
    """Runs `compiled` (stages placed as `stage_to_rank`, the training schedule's) over the
    forward-only schedule. `held`: the stages this process runs; `rank_of(stage, microbatch)`:
    the global rank of a stage (None: one process runs every rank, over `transport`)."""

    def __init__(
        self,
        compiled: CompiledForward,
        stage_to_rank: Sequence[int],
        microbatches: int,
        held: Sequence[int],
        state: Mapping[str, torch.Tensor],
        transport: MessageTransport,
        receive_device: torch.device | None,
        position: tuple[int, Callable[[int, int], int]] | None = None,
    ) -> None:
        self.compiled = compiled
        self.schedule = forward_only(stage_to_rank, microbatches)
        self.executors = {s: ForwardStage(compiled.programs[s], compiled.partition.stages[s], state) for s in held}
        self.interpreter = Interpreter(self.executors, transport, receive_device, False, None)
        self.interpreter.mail.symbols = compiled.traced.symbols  # a shape-generic compile's message shapes
        names = lambda carries, stage: compiled.partition.stages[stage].inputs  # noqa: E731 - activations only

        def layout(name: str) -> tuple[tuple, torch.dtype]:
            value = compiled.partition.values[name]
            return tuple(value.shape), value.dtype

        if position is None:
            program = single_process_program(self.schedule, names, layout)
        else:
            pp_rank, rank_of = position
            program = rank_program(self.schedule, pp_rank, rank_of, names, layout, None)
        self.interpreter.load(program, self.schedule)

    def run(
        self, inputs: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Values] | None:
        """One forward of every microbatch; the last stage's results per microbatch where this
        process holds the last stage, else None."""
        return self.interpreter.step(inputs, targets)

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        for executor in self.executors.values():
            executor.state = state

    def measure_transients(self, on: bool = True) -> None:
        for executor in self.executors.values():
            executor.measure_transients = on

    @property
    def peak_activation_bytes(self) -> int:
        """The most bytes alive inside an F of the stages held here (the largest of theirs:
        nothing lives between two F), counted while `measure_transients(True)`."""
        return max((e.peak_activation_bytes for e in self.executors.values()), default=0)

    def predicted_peak_bytes(self) -> tuple[int, ...]:
        """Per rank, the forward-only schedule's peak activation bytes: the largest F peak of
        its stages (`CompiledForward.peak_bytes`; no F leaves anything behind)."""
        peaks = [0] * self.schedule.ranks
        for stage, rank in enumerate(self.schedule.stage_to_rank):
            peaks[rank] = max(peaks[rank], self.compiled.peak_bytes[stage])
        return tuple(peaks)
