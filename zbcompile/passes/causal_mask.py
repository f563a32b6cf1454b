"""Pass: attention whose mask is a constant causal mask runs as `is_causal=True`.

A library that builds its causal mask while it is traced (transformers does whenever it is
compiled, exported or otherwise traced, since it cannot tell then whether a padding mask holds
padding) hands `scaled_dot_product_attention` a lower-triangular mask computed from `arange`
alone. Eager, the same library passes no mask and `is_causal=True`, and the GPU kernels skip the
masked half of the scores: with the mask, the traced attention does twice the work. This pass
finds each attention node whose mask depends on no input, parameter or buffer (and on no random
op), computes the mask on the CPU, and where it allows exactly what `is_causal=True` allows
(every query its own and earlier keys; a boolean mask, or 0 and at most half of the dtype's
lowest value, which softmax turns into exact zeros), traces `is_causal=True` attention on the
same query, key and value in its place. The mask's nodes are then dead. Masks computed alike (a
decoder's layers each build the same one) are computed and checked once: a 70B-class model's
80 masks of 4096 x 4096 cost one check. Attention with dropout,
with a mask that depends on the batch (padding), or with another pattern is left as it is.

    %mask = where(le(arange(...), arange(...)), 0, -inf)        # computed from nothing else
    %att  = _scaled_dot_product_efficient_attention(q, k, v, %mask, ...)
    ->
    %att  = _scaled_dot_product_flash_attention(q, k, v, 0.0, True, ...)   # whatever dispatch picks
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from zbcompile import _torch_internals as ti
from zbcompile._torch_internals import FakeTensorMode, OpOverload

aten = torch.ops.aten
# attention ops that take a mask, by the name of the mask argument in their schema
_MASKED_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
}
_MAX_MASK_ELEMENTS = 1 << 28  # a mask computed at compile time: at most this many elements


def fold_causal_masks(graph: fx.Graph, fake_mode: FakeTensorMode) -> int:
    """Replace, in place, attention nodes whose mask is a constant causal mask by `is_causal=True`
    attention traced under `fake_mode` (the graph's; see the module docstring); returns how many.
    The mask's nodes are left dead."""
    folded, causal, keys, values = 0, {}, {}, {}
    for node in list(graph.nodes):
        mask_name = _MASKED_ATTENTION.get(node.target)
        if mask_name is None:
            continue
        arguments = normalize_function(
            node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
        ).kwargs
        mask = arguments.get(mask_name)
        if not isinstance(mask, fx.Node) or arguments.get("dropout_p", 0.0) != 0.0 or arguments.get("is_causal"):
            continue
        if any(user.target is not operator.getitem or (user.args[1] != 0 and user.users) for user in node.users):
            continue  # only the attention's output is read (a forward graph's)
        key = _structure(mask, keys)  # every layer's mask computed alike is checked once
        if key not in causal:
            causal[key] = _is_constant_causal(mask, values)
        if causal[key] and _replace(graph, node, arguments, fake_mode):
            folded += 1
    return folded


def _structure(node: fx.Node, keys: dict[fx.Node, Any]) -> Any:
    """A hashable key equal for nodes that compute the same value from the same computation
    (op and constant arguments, recursively; a placeholder or a random op is itself), `keys`
    memoising it per node."""
    if node in keys:
        return keys[node]
    stack = [node]
    while stack:  # ancestors first, without recursion (a mask may descend from a long chain)
        current = stack.pop()
        if current in keys:
            continue
        pending = [n for n in current.all_input_nodes if n not in keys]
        if pending:
            stack.append(current)
            stack.extend(pending)
            continue
        if current.op != "call_function" or _seeded(current.target):
            keys[current] = ("node", id(current))
        else:
            arguments = fx.node.map_arg((current.args, current.kwargs), lambda n: keys[n])
            keys[current] = (current.target, _hashable(arguments))
    return keys[node]


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


def _is_constant_causal(mask: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """Whether `mask` depends on no placeholder and no random op, and its value allows exactly
    the causal pattern in every slice of its last two dimensions (`values`: nodes computed so
    far, shared between masks)."""
    value = _evaluate(mask, values)
    if value is None or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return False
    length = value.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == causal).all())
    if not value.is_floating_point():
        return False
    lowest = torch.finfo(value.dtype).min / 2
    return bool(torch.where(causal, value == 0, value <= lowest).all())


def _evaluate(node: fx.Node, values: dict[fx.Node, Any]) -> torch.Tensor | None:
    """`node`'s value computed on the CPU from its ancestors (those in `values` already computed;
    the others added), or None when it depends on a placeholder or a random op, or is too large
    to compute at compile time."""
    order, seen, stack = [], set(), [node]
    while stack:
        current = stack.pop()
        if current in seen or current in values:
            continue
        seen.add(current)
        if current.op != "call_function" or _seeded(current.target):
            return None
        order.append(current)
        stack.extend(current.all_input_nodes)
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.numel() > _MAX_MASK_ELEMENTS:
        return None
    try:
        for current in sorted(order, key=_position(node.graph)):
            args, kwargs = fx.node.map_arg((current.args, current.kwargs), lambda n: values[n])
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            values[current] = current.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that will not run on the CPU: leave the mask as it is
        return None
    return values[node] if isinstance(values[node], torch.Tensor) else None


def _seeded(target: Any) -> bool:
    return isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _position(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def _replace(graph: fx.Graph, node: fx.Node, arguments: dict[str, Any], fake_mode: FakeTensorMode) -> bool:
    """Trace `is_causal=True` attention of `node`'s query, key and value and splice it in place
    of `node`'s output; False (and nothing changed) where the trace fails."""
    query, key, value = (arguments[name] for name in ("query", "key", "value"))
    scale = arguments.get("scale")

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    examples = [n.meta["val"] for n in (query, key, value)]
    try:
        with fake_mode:
            sub = ti.make_fx(causal)(*examples)
    except Exception:  # noqa: BLE001 - no kernel for this case: keep the mask
        return False
    env = dict(zip(sub.graph.find_nodes(op="placeholder"), (query, key, value)))
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "call_function":
                env[inner] = graph.node_copy(inner, lambda n: env[n])
                env[inner].meta = {**node.meta, "val": inner.meta.get("val")}
    result = env[sub.graph.output_node().args[0]]
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(result)
        graph.erase_node(user)
    graph.erase_node(node)
    return True
