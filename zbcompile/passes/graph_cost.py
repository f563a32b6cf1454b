"""Pass: cost of graphs and nodes. Static: FLOPs from torch's FLOP formulas (matmuls,
convolutions, attention) evaluated on the fake tensors in `node.meta["val"]`, and bytes, the
sizes of the values a node writes (views write nothing). Measured, on request: the median time
of a stage's F, I and W on this machine (`measure_stage_times`)."""

from __future__ import annotations

import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import sympy
import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile._torch_internals import pytree
from zbcompile.passes import _fx, tensor_parallel
from zbcompile.passes._fx import is_view_op, node_bytes
from zbcompile.passes.program import Program
from zbcompile.value_names import is_state

# Weight of one written byte against one FLOP when balancing stages: elementwise work is
# bandwidth-bound, so a byte costs about as much time as a few FLOPs on CPUs and GPUs alike.
FLOPS_PER_BYTE = 4.0


def _meta_value(argument: object) -> object:
    return argument.meta.get("val") if isinstance(argument, fx.Node) else argument


def node_flops(node: fx.Node, symbolic: bool = False) -> Any:
    """FLOPs of one call_function node (0 for ops without a formula; a tensor-parallel module's
    call, the FLOPs of its local ops); of symbolic sizes, at the example traced, or with
    `symbolic` as an expression of the sizes (`passes/shape_symbols.py`)."""
    if tensor_parallel.is_call(node):
        return tensor_parallel.call_of(node).flops
    if node.op != "call_function" or not ti.has_flop_formula(node.target):
        return 0
    args, kwargs = pytree.tree_map(_meta_value, (node.args, node.kwargs))
    flops = ti.count_flops(node.target, args, kwargs, node.meta.get("val"), symbolic)
    share = node.meta.get("custom", {}).get(_fx.TP_FLOPS)  # a plan's tensor-parallel share
    return flops if share is None else int(flops * share)


def node_written_bytes(node: fx.Node) -> int:
    if node.op != "call_function" or is_view_op(node):
        return 0
    return node_bytes(node)


def node_cost(node: fx.Node) -> float:
    """Estimated time of a node in FLOP-equivalents (see FLOPS_PER_BYTE)."""
    return node_flops(node) + FLOPS_PER_BYTE * node_written_bytes(node)


@dataclass(frozen=True)
class GraphCost:
    """Totals over a graph's call_function nodes."""

    flops: int
    written_bytes: int

    @property
    def time_estimate(self) -> float:
        return self.flops + FLOPS_PER_BYTE * self.written_bytes


def cost_formula(graph_module: fx.GraphModule) -> Any:
    """The graph's `GraphCost.time_estimate` as a sympy expression of its symbolic sizes (a
    number for a graph of one shape): FLOPs and written bytes, each node's as its shape says."""
    total = sympy.Integer(0)
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        total += node_flops(node, symbolic=True)
        if not is_view_op(node):
            total += FLOPS_PER_BYTE * _fx.symbolic_bytes(node.meta.get("val"))
    return total


def graph_cost(graph_module: fx.GraphModule) -> GraphCost:
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    return GraphCost(
        flops=sum(node_flops(n) for n in nodes),
        written_bytes=sum(node_written_bytes(n) for n in nodes),
    )


@dataclass(frozen=True)
class MeasuredTimes:
    """Median wall-clock seconds of one microbatch's F, I and W on this machine."""

    forward: float
    input_backward: float
    weight_backward: float


def random_inputs(program, state: Mapping[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors for every input of a `Program` that `state` does not hold, shaped, strided
    and typed like the traced values (integers in [0, 8), so they index any embedding)."""
    env = {}
    for node, name in zip(program.graph.graph.find_nodes(op="placeholder"), program.signature.inputs):
        if name in state:
            continue
        value = node.meta["val"]
        if value.is_floating_point() or value.is_complex():
            data = torch.randn(value.shape, dtype=value.dtype, generator=generator)
        else:
            data = torch.randint(0, 8, value.shape, dtype=value.dtype, generator=generator)
        env[name] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(data)
    return env


def measure_stage_times(program, state: Mapping[str, torch.Tensor], repeats: int = 5, seed: int = 0) -> MeasuredTimes:
    """Run a StageProgram's F, then I, then W on random inputs `repeats` times (after one warm-up
    run) and return the median time of each."""
    generator = torch.Generator().manual_seed(seed)
    samples: dict[str, list[float]] = {"forward": [], "input_backward": [], "weight_backward": []}
    with torch.no_grad():
        for attempt in range(repeats + 1):
            env = random_inputs(program.forward, state, generator)
            for graph_name in samples:
                graph = getattr(program, graph_name)
                if graph_name == "input_backward":  # the tangents (W may read them when I is empty)
                    env.update(random_inputs(program.joint.backward, {**state, **env}, generator))
                started = time.perf_counter()
                graph.run(env, state)
                if attempt:
                    samples[graph_name].append(time.perf_counter() - started)
    return MeasuredTimes(**{k: statistics.median(v) for k, v in samples.items()})


def peak_bytes(program: Program, kept: Collection[str], held: int = 0) -> int:
    """The most bytes alive at once while `program` runs as the runtime runs it (static, from
    the graph's order and the sizes in `meta["val"]`): its inputs other than parameters and
    buffers from the start, each freed after its last use unless named in `kept` (what the
    caller still holds); every value a node creates (views create none) from that node until
    its last use; the outputs until the end; plus `held` bytes the action holds throughout
    without reading them. Counted right after each node, when its inputs are
    still alive, as `runtime.live_memory.TransientTracker` counts. Placeholders count apart even
    where they share one storage at run time."""
    graph = program.graph.graph
    nodes = list(graph.nodes)
    roots = _fx.storage_roots(graph)
    names = dict(zip(graph.find_nodes(op="placeholder"), program.signature.inputs))
    held_to_end = {roots[n] for n in pytree.tree_leaves(graph.output_node().args) if isinstance(n, fx.Node)}
    held_to_end |= {n for n, name in names.items() if name in kept}
    last_use: dict[fx.Node, int] = {}
    for position, node in enumerate(nodes):
        for source in node.all_input_nodes:
            last_use[roots[source]] = position
    sizes = {n: _fx.node_bytes(n) for n, name in names.items() if not is_state(name)}
    current = peak = held + sum(sizes.values())
    freed_after: dict[int, list[fx.Node]] = {}
    for root in sizes:
        if root not in held_to_end:
            freed_after.setdefault(last_use.get(root, -1), []).append(root)
    current -= sum(sizes[r] for r in freed_after.pop(-1, []))
    for position, node in enumerate(nodes):
        if node.op == "call_function" and roots[node] is node and not _of_multi_output(node):
            # a tuple-valued op allocates every element: those read on belong to their getitems
            owners = [u for u in node.users if roots[u] is u] if _fx.is_multi_output(node) else [node]
            sizes.update((owner, _fx.node_bytes(owner)) for owner in owners)
            created = _fx.node_bytes(node)
            current += created
            peak = max(peak, current)
            current -= created - sum(sizes[owner] for owner in owners)  # elements nothing reads
            for owner in owners:
                if owner not in held_to_end:
                    freed_after.setdefault(max(position, last_use.get(owner, position)), []).append(owner)
        current -= sum(sizes[r] for r in freed_after.pop(position, []))
    return peak


def _of_multi_output(node: fx.Node) -> bool:
    """A getitem of a tuple-valued op: allocated by that op, counted there."""
    return node.target is operator.getitem and _fx.is_multi_output(node.args[0])
