"""Compile a pipeline's stage programs (F, I, W and the fused backward B) for execution.

"eager" keeps the programs as they are: their aten graphs run op by op. "inductor" compiles each
graph with Inductor (on CPU it generates C++ and needs the C++ toolchain) the first time it runs,
for the inputs it runs on then (later calls must match their shapes, strides and dtypes, which
they do: every microbatch of a compiled pipeline is shaped alike). Graphs the schedule never runs
(the fused backward under a split schedule) are never compiled. `compiler=None` (the default)
means "inductor" on CUDA, where it pays for itself (benchmarks/results/gpu_throughput.md: a 1B
Llama's step 1.33x faster, the paper's GPT no slower; the first step some 30-40 s longer), with
a graph Inductor cannot compile run op by op instead (a warning names it), and "eager" elsewhere.
"""

from __future__ import annotations

import dataclasses
import warnings
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
            f"pipeline(): unknown compiler {compiler!r}; choose one of {', '.join(STAGE_COMPILERS)} (or None: "
            "inductor on CUDA, eager elsewhere)"
        )


def compile_stage_programs(
    compiled: CompiledPipeline, compiler: str | None, device: torch.device | None = None
) -> CompiledPipeline:
    """`compiled` with every stage's graphs compiled by `compiler` for programs that run on
    `device` (see the module docstring for `compiler=None`)."""
    check_compiler(compiler)
    chosen = compiler or ("inductor" if device is not None and device.type == "cuda" else "eager")
    if chosen == "eager":
        return compiled
    fallback = compiler is None
    return dataclasses.replace(compiled, programs=tuple(_compile_stage(p, fallback) for p in compiled.programs))


def _compile_stage(program: StageProgram, fallback: bool) -> StageProgram:
    joint, split = program.joint, program.split

    def inductor(part: Program, name: str) -> Program:
        if not any(n.op == "call_function" for n in part.graph.graph.nodes):
            return part  # nothing to compute (the first stage's I)
        return InductorProgram(part.graph, part.signature, name=f"stage {program.index}'s {name}", fallback=fallback)

    return dataclasses.replace(
        program,
        joint=dataclasses.replace(joint, forward=inductor(joint.forward, "F"), backward=inductor(joint.backward, "B")),
        split=dataclasses.replace(
            split,
            input_backward=inductor(split.input_backward, "I"),
            weight_backward=inductor(split.weight_backward, "W"),
        ),
    )


@dataclass(frozen=True)
class InductorProgram(Program):
    """A Program whose graph runs as Inductor-generated code, compiled on its first run; with
    `fallback`, a graph Inductor fails to compile runs op by op instead, with a warning naming
    it (`name`)."""

    name: str = "a stage program"
    fallback: bool = False
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
            try:
                fn = ti.inductor_compile(self.graph, inputs)
            except Exception as error:  # noqa: BLE001 - the default's fallback; re-raised when asked for inductor
                if not self.fallback:
                    raise
                warnings.warn(
                    f"{self.name}: Inductor could not compile it ({type(error).__name__}: {error}); it runs op by op. "
                    "Pass compiler='eager' to pipeline() to skip Inductor, or compiler='inductor' to see the error",
                    stacklevel=2,
                )
                fn = self.graph
            self._compiled["fn"] = lambda args: fn(*args)
        return self._compiled["fn"]
