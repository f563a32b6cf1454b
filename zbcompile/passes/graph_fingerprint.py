"""A canonical form of an FX graph with node, parameter and buffer names left out.

`graph_fingerprint(graph)` lists every node's op, target, arguments (by position of the nodes
they read), keyword arguments and the shape, strides and dtype of its value, and a parameter's
or buffer's shape and dtype instead of its name. Two graphs with equal fingerprints compute the
same function of their inputs and parameters, op for op. Used to find identical stages
(`stage_reuse`) and identical blocks (`block_joint`).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import fx

from zbcompile.passes import _fx
from zbcompile.passes.trace import ROLE_BUFFER, ROLE_PARAM


def _sizes_form(sizes: Any) -> tuple:
    """Sizes or strides, a symbolic one by its expression (`passes/shape_symbols.py`)."""
    return tuple(str(s.node.expr) if isinstance(s, torch.SymInt) else s for s in sizes)


def _value_form(value: Any) -> Hashable:
    """Shape, strides and dtype of a traced value (tuples of them for multi-output ops)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _sizes_form(value.shape), _sizes_form(value.stride()), str(value.dtype), value.requires_grad)
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


def graph_fingerprint(graph_module: fx.GraphModule, constants_by_value: bool = False) -> tuple[Hashable, ...]:
    """The canonical form of `graph_module`'s graph (see the module docstring); equal for graphs
    that differ only in node, parameter and buffer names. Checkpoint regions count by the order
    they first appear in. Tensor constants count by name, or with `constants_by_value` by
    shape, dtype and value (two blocks' equal constants, made once per block)."""
    index: dict[fx.Node, int] = {}
    regions: dict[Any, int] = {}
    form: list[Hashable] = []
    for position, node in enumerate(graph_module.graph.nodes):
        index[node] = position
        value = _value_form(node.meta.get("val"))
        if node.op == "get_attr":
            attribute = _fx.get_attr_value(graph_module, node.target)
            state = isinstance(attribute, torch.Tensor) and (
                isinstance(attribute, torch.nn.Parameter) or node.meta.get("zb_role") in (ROLE_PARAM, ROLE_BUFFER)
            )
            # parameters and buffers by shape and dtype; tensor constants by their name (the same object everywhere)
            if state:
                identity = _value_form(attribute)
            elif constants_by_value and isinstance(attribute, torch.Tensor) and not attribute.is_meta:
                identity = (
                    _value_form(attribute),
                    attribute.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
                )
            else:
                identity = node.target
            form.append(("get_attr", identity, node.meta.get("zb_role")))
            continue
        region = node.meta.get("custom", {}).get("checkpoint")
        if region is not None:
            region = regions.setdefault(region, len(regions))
        # placeholders by position (their targets are value names); ops by what they call
        target = "" if node.op == "placeholder" else str(node.target)
        form.append(
            (node.op, str(target), _argument_form(node.args, index), _argument_form(node.kwargs, index), value, region)
        )
    return tuple(form)
