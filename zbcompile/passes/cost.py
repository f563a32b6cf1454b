"""Pass: static cost of graphs and nodes. FLOPs come from torch's FLOP formulas (matmuls,
convolutions, attention) evaluated on the fake tensors in `node.meta["val"]`; bytes are the sizes
of the values a node writes (views write nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.utils import _pytree as pytree

from zbcompile import _torch_internals as ti
from zbcompile.passes._fx import is_view_op, node_bytes

# Weight of one written byte against one FLOP when balancing stages: elementwise work is
# bandwidth-bound, so a byte costs about as much time as a few FLOPs on CPUs and GPUs alike.
FLOPS_PER_BYTE = 4.0


def _meta_value(argument: object) -> object:
    return argument.meta.get("val") if isinstance(argument, fx.Node) else argument


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call_function node (0 for ops without a formula)."""
    if node.op != "call_function" or not ti.has_flop_formula(node.target):
        return 0
    args, kwargs = pytree.tree_map(_meta_value, (node.args, node.kwargs))
    return ti.count_flops(node.target, args, kwargs, node.meta.get("val"))


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


def graph_cost(graph_module: fx.GraphModule) -> GraphCost:
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    return GraphCost(
        flops=sum(node_flops(n) for n in nodes),
        written_bytes=sum(node_written_bytes(n) for n in nodes),
    )
