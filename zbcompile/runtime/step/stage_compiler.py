"""Compile a pipeline's stage programs (F, I, W and the fused backward B) for execution.

"eager" keeps the programs as they are: their aten graphs run op by op from Python. "traced"
records each graph's ops once, on its first run (`torch.jit.trace`, the RNG state put back
after), and runs them from C++ from then on: the same ops in the same order on the same inputs,
so the same bits as "eager", without a Python call per op (2-5 us each: a small model's stage
program of 500 ops ran 1.7x faster on one CPU core). It holds a graph's inputs until the graph
returns, where "eager" frees each at its last use; a graph with other than aten ops (a
tensor-parallel collective) or that the tracer refuses runs op by op, as every graph does while
a dispatch mode watches (the runtime's memory measurement counts the storages alive op by op).

"inductor" compiles each graph with Inductor (on CPU it generates C++ and needs the C++
toolchain) the first time it runs, for the inputs it runs on then (later calls must match their
shapes, strides and dtypes, which they do: every microbatch of a compile of one shape is shaped
alike; a shape-generic graph, whose sizes are int inputs, is compiled per sizes, for
`RECORDED_SIZES` at most, and "traced" scripts it once with TorchScript instead of recording it).
Graphs the schedule never runs (the fused backward under a split schedule) are never compiled.
`compiler=None` (the default) means "inductor" on CUDA, where it pays for itself
(benchmarks/results/gpu_throughput.md: a 1B Llama's step 1.33x faster, the paper's GPT no slower;
the first step some 30-40 s longer), with a graph Inductor cannot compile run op by op instead
(a warning names it), and "traced" elsewhere.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import torch

from zbcompile import _torch_internals as ti
from zbcompile.compiler import CompiledPipeline, StageProgram
from zbcompile.options import check_compiler
from zbcompile.passes.program import Program


def compile_stage_programs(
    compiled: CompiledPipeline, compiler: str | None, device: torch.device | None = None
) -> CompiledPipeline:
    """`compiled` with every stage's graphs compiled by `compiler` for programs that run on
    `device` (see the module docstring for `compiler=None`)."""
    check_compiler(compiler)
    chosen = compiler or ("inductor" if device is not None and device.type == "cuda" else "traced")
    if chosen == "eager":
        return compiled

    def make(part: Program, stage: int, kind: str) -> Program:
        if chosen == "traced":
            return TracedProgram(part.graph, part.signature)
        return InductorProgram(part.graph, part.signature, name=f"stage {stage}'s {kind}", fallback=compiler is None)

    return dataclasses.replace(compiled, programs=tuple(each_graph(p, make) for p in compiled.programs))


def each_graph(program: StageProgram, make: Callable[[Program, int, str], Program]) -> StageProgram:
    """`program` with each graph that computes something made by `make(graph, stage index, kind)`
    (kind: "F", "B", "I" or "W"); a graph without ops (the first stage's I) stays as it is."""
    joint, split = program.joint, program.split

    def made(part: Program, kind: str) -> Program:
        if not any(n.op == "call_function" for n in part.graph.graph.nodes):
            return part
        return make(part, program.index, kind)

    return dataclasses.replace(
        program,
        joint=dataclasses.replace(joint, forward=made(joint.forward, "F"), backward=made(joint.backward, "B")),
        split=dataclasses.replace(
            split, input_backward=made(split.input_backward, "I"), weight_backward=made(split.weight_backward, "W")
        ),
    )


RECORDED_SIZES = 8
"""Inductor compiles a shape-generic graph (one that takes sizes, `passes/shape_symbols.py`) once
per distinct sizes it runs at, for at most this many; at other sizes it runs op by op."""


def sizes_key(inputs: list[Any]) -> tuple[int, ...]:
    """The sizes a shape-generic graph takes (its int inputs); () for a graph of one shape."""
    return tuple(x for x in inputs if isinstance(x, int))


@dataclass(frozen=True)
class TracedProgram(Program):
    """A Program whose graph's ops, recorded on its first run, run from C++ (see the module
    docstring); one the tracer cannot record runs op by op. A shape-generic graph (its sizes are
    int inputs, `passes/shape_symbols.py`) is scripted by TorchScript instead, once, and runs at
    every size from C++."""

    _traced: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def run(
        self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], consumed: Collection[str] = ()
    ) -> None:
        if self._traced.get("fn") is False or ti.dispatch_mode_active():
            return super().run(env, state, consumed)  # op by op, each input freed at its last use
        inputs = self._inputs(env, state, consumed)
        with torch.no_grad(), torch.jit.optimized_execution(False):  # the recorded ops as they are
            if "fn" not in self._traced:
                generic = bool(sizes_key(inputs))
                self._traced["fn"] = (scripted(self.graph) if generic else ti.traced(self.graph, inputs)) or False
            try:
                results = (self._traced["fn"] or self.graph)(*inputs)
            except Exception:  # noqa: BLE001 - run op by op again: the error then names its node
                results = self.graph(*inputs)
        env.update(zip(self.signature.outputs, results))


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
        """The graph compiled for these inputs' sizes (one compile for a graph of one shape; per
        sizes, at most `RECORDED_SIZES`, for a shape-generic one: op by op beyond)."""
        key = sizes_key(inputs)
        if key not in self._compiled and len(self._compiled) >= RECORDED_SIZES:
            return lambda args: self.graph(*args)
        if key not in self._compiled:
            graph, tensors = at_sizes(self.graph, inputs)
            try:
                fn = ti.inductor_compile(graph, tensors)
            except Exception as error:  # noqa: BLE001 - the default's fallback; re-raised when asked for inductor
                if not self.fallback:
                    raise
                warnings.warn(
                    f"{self.name}: Inductor could not compile it ({type(error).__name__}: {error}); it runs op by op. "
                    "Pass compiler='eager' to pipeline() to skip Inductor, or compiler='inductor' to see the error",
                    stacklevel=2,
                )
                fn = graph
            self._compiled[key] = lambda args: fn(*(a for a in args if not isinstance(a, int)))
        return self._compiled[key]


def scripted(gm: torch.fx.GraphModule) -> Callable | None:
    """`gm` compiled by TorchScript's scripting (run with `torch.jit.optimized_execution(False)`:
    its aten ops as they are, one C++ call for the graph): a graph whose sizes are int inputs
    runs at every size from one compile. None where TorchScript refuses it."""
    graph = gm.graph.__deepcopy__()
    for node in graph.nodes:
        if node.op == "placeholder":
            node.type = torch.Tensor if isinstance(node.meta.get("val"), torch.Tensor) else int
        elif node.op == "call_function" and isinstance(node.target, ti.OpOverload):
            node.target = node.target.overloadpacket  # TorchScript resolves the overload by its schema
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(torch.fx.GraphModule(gm, graph))
    except Exception:  # noqa: BLE001 - whatever TorchScript refuses runs op by op
        return None


def at_sizes(graph_module: torch.fx.GraphModule, inputs: list[Any]) -> tuple[torch.fx.GraphModule, list[Any]]:
    """A copy of `graph_module` whose int inputs are constants of their values in `inputs`, and
    the tensors it takes (`graph_module` and `inputs` themselves for a graph of one shape)."""
    if not sizes_key(inputs):
        return graph_module, inputs
    graph = torch.fx.Graph()
    values = {}
    for node, value in zip(graph_module.graph.find_nodes(op="placeholder"), inputs):
        if isinstance(value, int):
            values[node] = value
    env: dict[Any, Any] = dict(values)
    for node in graph_module.graph.nodes:
        if node not in values:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(graph_module, graph), [x for x in inputs if not isinstance(x, int)]
