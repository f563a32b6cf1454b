"""Compile a pipeline's stage programs (F, I, W and the fused backward B) for execution.

`compiler=None` or "eager" keeps the programs as they are: their aten graphs run op by op.
"inductor" compiles each graph with Inductor (on CPU it generates C++ and needs the C++
toolchain) the first time it runs, for the inputs it runs on then (later calls must match their
shapes, strides and dtypes, which they do: every microbatch of a compiled pipeline is shaped
alike). Graphs the schedule never runs (the fused backward under a split schedule) are never
compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import torch

from zbcompile import _torch_internals as ti
from zbcompile.compiler import CompiledPipeline, StageProgram
from zbcompile.program import Program

STAGE_COMPILERS = ("eager", "inductor")


def check_compiler(compiler: str | None) -> None:
    if compiler is not None and compiler not in STAGE_COMPILERS:
        raise ValueError(
            f"pipeline(): unknown compiler {compiler!r}; choose one of {', '.join(STAGE_COMPILERS)} (or None, eager)"
        )


def compile_stage_programs(compiled: CompiledPipeline, compiler: str | None) -> CompiledPipeline:
    """`compiled` with every stage's graphs compiled by `compiler` (see the module docstring)."""
    check_compiler(compiler)
    if compiler in (None, "eager"):
        return compiled
    return dataclasses.replace(compiled, programs=tuple(_compile_stage(p) for p in compiled.programs))


def _compile_stage(program: StageProgram) -> StageProgram:
    joint, split = program.joint, program.split
    return dataclasses.replace(
        program,
        joint=dataclasses.replace(joint, forward=_inductor(joint.forward), backward=_inductor(joint.backward)),
        split=dataclasses.replace(
            split, input_backward=_inductor(split.input_backward), weight_backward=_inductor(split.weight_backward)
        ),
    )


def _inductor(program: Program) -> Program:
    if not any(n.op == "call_function" for n in program.graph.graph.nodes):
        return program  # nothing to compute (the first stage's I)
    return InductorProgram(program.graph, program.signature)


@dataclass(frozen=True)
class InductorProgram(Program):
    """A Program whose graph runs as Inductor-generated code, compiled on its first run."""

    _compiled: dict[str, Callable] = field(default_factory=dict, compare=False, repr=False)

    def run(
        self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], consumed: Collection[str] = ()
    ) -> None:
        inputs = self._inputs(env, state, consumed)
        with torch.no_grad():
            results = self._compiled_for(inputs)(inputs)
        env.update(zip(self.signature.outputs, results))

    def _compiled_for(self, inputs: list[Any]) -> Callable:
        if "fn" not in self._compiled:
            fn = ti.inductor_compile(self.graph, inputs)
            self._compiled["fn"] = lambda args: fn(*args)
        return self._compiled["fn"]
