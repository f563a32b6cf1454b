"""Pass: which stages compile to the same programs, so that their joint graphs, I/W split and
costs are computed once.

A deep model cut into many stages repeats itself: the middle stages of an 80-layer decoder cut
in eight each hold ten identical blocks. `graph_fingerprint(graph)` is a canonical form of an FX
graph with node, parameter and buffer names left out: every node's op, target, arguments (by
position of the nodes they read), keyword arguments and the shape, strides and dtype of its
value, and a parameter's or buffer's shape and dtype instead of its name. Two graphs with equal
fingerprints compute the same function of their inputs and parameters, op for op.
`stage_fingerprint` adds what the joint pass reads besides the graph: which inputs carry a
gradient, which outputs get one from the next stage, whether the stage computes the loss, and
its buffer updates. Stages with equal stage fingerprints export identical joint graphs (up to
names), split identically and cost the same (FLOPs, bytes, M_B, M_W, action peaks), which
`tests/passes/test_stage_reuse.py` checks against compiling every stage.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import fx

from zbcompile.passes.partition import Stage, StagePartition


def _value_form(value: Any) -> Hashable:
    """Shape, strides and dtype of a traced value (tuples of them for multi-output ops)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_value_form(v) for v in value)
    return repr(value)


def _argument_form(argument: Any, index: dict[fx.Node, int]) -> Hashable:
    if isinstance(argument, fx.Node):
        return ("node", index[argument])
    if isinstance(argument, (tuple, list)):
        return (type(argument).__name__, tuple(_argument_form(a, index) for a in argument))
    if isinstance(argument, dict):
        return ("dict", tuple(sorted((k, _argument_form(v, index)) for k, v in argument.items())))
    return repr(argument)


def graph_fingerprint(graph_module: fx.GraphModule) -> tuple[Hashable, ...]:
    """The canonical form of `graph_module`'s graph (see the module docstring); equal for graphs
    that differ only in node, parameter and buffer names. Checkpoint regions count by the order
    they first appear in."""
    index: dict[fx.Node, int] = {}
    regions: dict[Any, int] = {}
    form: list[Hashable] = []
    for position, node in enumerate(graph_module.graph.nodes):
        index[node] = position
        value = _value_form(node.meta.get("val"))
        if node.op == "get_attr":
            attribute = _attribute(graph_module, node.target)
            state = isinstance(attribute, torch.Tensor) and (
                isinstance(attribute, torch.nn.Parameter) or node.meta.get("zb_role") in ("param", "buffer")
            )
            # parameters and buffers by shape and dtype; tensor constants by their name (the same object everywhere)
            form.append(("get_attr", _value_form(attribute) if state else node.target, node.meta.get("zb_role")))
            continue
        region = node.meta.get("custom", {}).get("checkpoint")
        if region is not None:
            region = regions.setdefault(region, len(regions))
        # placeholders by position (their targets are value names); ops by what they call
        target = "" if node.op == "placeholder" else str(node.target)
        form.append((node.op, str(target), _argument_form(node.args, index), _argument_form(node.kwargs, index), value, region))
    return tuple(form)


def _attribute(module: torch.nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def stage_fingerprint(stage: Stage, partition: StagePartition, grads_from_next: set[str], last: bool) -> tuple[Hashable, ...]:
    """The stage's graph fingerprint with what its joint export depends on besides the graph:
    which inputs may carry a gradient (by position), which outputs get one from the next stage,
    whether it computes the loss, and how many buffers it updates."""
    differentiable = tuple(
        bool(partition.values[n].differentiable) if n in partition.values else None for n in stage.graph_inputs
    )
    receives_grads = tuple(o in grads_from_next for o in stage.graph_outputs)
    return (graph_fingerprint(stage.module), differentiable, receives_grads, last, len(stage.buffer_updates))
