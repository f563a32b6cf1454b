"""Pass (inside joint separation): which forward values the backward recomputes instead of
reading them saved from F.

A forward node is *recomputable* when it was traced inside a `torch.utils.checkpoint` region
(`trace.CHECKPOINT` in its `meta["custom"]`) or was chosen by `recompute="auto"` (see
`runtime/tuning/auto_recompute.py`), and is not random (a dropout mask is drawn once, in F, and saved).
`recompute_closure` adds to the backward every recomputable value it would otherwise read
from F, then every recomputable value those need, and so on: F then saves only what the
recomputation starts from (a checkpoint region's inputs), as eager checkpointing does. The
backward holds each recomputed node once; splitting it into I and W (split_backward) keeps it
once, so a region's forward runs once for I and W together, never twice.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import fx

from zbcompile.passes import _fx
from zbcompile.passes.trace import CHECKPOINT


def in_checkpoint_region(node: fx.Node) -> bool:
    return node.meta.get("custom", {}).get(CHECKPOINT) is not None


def recomputable(node: fx.Node) -> bool:
    """Whether the backward may compute `node` again: a deterministic call_function (a getitem
    only with its tuple-valued op)."""
    if node.op != "call_function" or _fx.is_random(node):
        return False
    if node.target is operator.getitem:
        return recomputable(node.args[0])
    return True


def checkpointed_nodes(forward_nodes: Iterable[fx.Node], also: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """The forward nodes traced inside checkpoint regions (or accepted by `also`) that may be
    recomputed."""
    return {n for n in forward_nodes if (in_checkpoint_region(n) or (also is not None and also(n))) and recomputable(n)}


# --- levels of compiler-chosen recomputation (recompute="auto"), cheapest first -------------------

_CHEAP_NON_POINTWISE = {
    torch.ops.aten._to_copy.default, torch.ops.aten.clone.default, torch.ops.aten.expand.default,
    torch.ops.aten.embedding.default,
}
_NORMS_AND_REDUCTIONS = {
    torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default,
    torch.ops.aten._fused_rms_norm.default, torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim,
    torch.ops.aten.amax.default, torch.ops.aten.var_mean.correction, torch.ops.aten._softmax.default,
    torch.ops.aten._log_softmax.default,
}


def elementwise(node: fx.Node) -> bool:
    """Pointwise ops, views and copies: bandwidth-bound, cheap to run again."""
    target = node.target
    if target is operator.getitem:
        return elementwise(node.args[0])
    return torch.Tag.pointwise in getattr(target, "tags", ()) or _fx.is_view_op(node) or target in _CHEAP_NON_POINTWISE


def elementwise_or_norm(node: fx.Node) -> bool:
    """Also normalisations, softmaxes and reductions (one pass over their input)."""
    target = node.args[0].target if node.target is operator.getitem else node.target
    return elementwise(node) or target in _NORMS_AND_REDUCTIONS


def everything(node: fx.Node) -> bool:
    """Every deterministic op, matmuls and attention included: the whole stage recomputed."""
    return True


@dataclass(frozen=True)
class RecomputeLevel:
    """What the backward recomputes: the forward nodes `recompute` accepts. Where W goes:
    `weight_recomputes`: W computes again the recomputed values it needs rather than keeping
    I's copy; `defer_weights=False`: every weight gradient is computed in I (W holds nothing,
    but has no work left to fill the pipeline's bubbles)."""

    name: str
    recompute: Callable[[fx.Node], bool]
    weight_recomputes: bool = False
    defer_weights: bool = True


# recompute="auto" weighs every level of a stage by the schedule's simulated time; level 0 (no
# entry) recomputes only checkpoint regions
RECOMPUTE_LEVELS: tuple[RecomputeLevel, ...] = (
    RecomputeLevel("elementwise", elementwise),
    RecomputeLevel("elementwise+norm", elementwise_or_norm),
    RecomputeLevel("elementwise+norm, weight grads in I", elementwise_or_norm, defer_weights=False),
    RecomputeLevel("all", everything),
    RecomputeLevel("all, W recomputes too", everything, weight_recomputes=True),
    RecomputeLevel("all, weight grads in I", everything, defer_weights=False),
)


def recompute_closure(backward_nodes: set[fx.Node], candidates: set[fx.Node]) -> set[fx.Node]:
    """The forward nodes among `candidates` that the backward (`backward_nodes`) computes again
    instead of reading saved: those it reads, then those they read, and so on."""
    recomputed: set[fx.Node] = set()
    frontier = list(backward_nodes)
    while frontier:
        node = frontier.pop()
        for source in node.all_input_nodes:
            if source in candidates and source not in recomputed:
                recomputed.add(source)
                frontier.append(source)
    return recomputed


def recompute_when_needed(graph_module: fx.GraphModule, recomputed: Iterable[str]) -> None:
    """Reorder the backward `graph_module` so that each recomputed node (named in `recomputed`)
    runs right before the first node that reads it, after the recomputed nodes it reads, rather
    than where the forward had it (all recomputation first). The backward then recomputes a
    checkpoint region when its own backward begins and frees its values when that ends, as eager
    checkpointing does: it holds one region's recomputed values at a time, not every region's.
    Only the order changes (each node computes what it did), so every result is the same."""
    graph, names = graph_module.graph, set(recomputed)
    pending = {n for n in graph.nodes if n.op == "call_function" and n.name in names}
    for node in list(graph.nodes):
        if node in pending:
            continue
        for needed in _recomputed_inputs_first(node, pending):
            node.prepend(needed)
    graph.lint()
    graph_module.recompile()


def _recomputed_inputs_first(node: fx.Node, pending: set[fx.Node]) -> list[fx.Node]:
    """The nodes of `pending` that `node` needs, directly or through each other, each after
    those it reads (taken out of `pending`)."""
    order: list[fx.Node] = []
    stack = [(source, False) for source in reversed(node.all_input_nodes) if source in pending]
    while stack:
        current, inputs_done = stack.pop()
        if current not in pending:
            continue
        if inputs_done:
            pending.discard(current)
            order.append(current)
            continue
        stack.append((current, True))
        stack.extend((source, False) for source in reversed(current.all_input_nodes) if source in pending)
    return order
