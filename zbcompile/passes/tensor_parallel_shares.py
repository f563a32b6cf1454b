"""Pass (planning): what one of `tp` tensor-parallel ranks computes, holds and communicates of each
traced node, for `zbcompile.plan(tp=...)`, from the whole model's trace (no DTensor, no process
group: a 70B-class model plans in one CPU process with its blocks traced once).

A plan names modules column-wise or row-wise (torch's `ColwiseParallel` / `RowwiseParallel`, or
transformers' plan strings "colwise", "rowwise", "colwise_gather_output", ...). Megatron-LM's
accounting, per node, in `node.meta["custom"]` (which every stage graph and its F, I and W programs
inherit, so the cost passes count it: `graph_cost.node_flops`, `_fx.node_bytes`):

- a column-wise module's ops: 1/tp of their FLOPs and bytes (its output is a shard of the features);
- a row-wise module's ops: 1/tp of their FLOPs, their whole bytes (each rank sums a whole output);
- the ops between a column-wise module's output and a row-wise module's input (attention on the
  rank's heads, the MLP's activation): 1/tp of both;
- with sequence parallelism, every other op on activations: 1/tp of both (each rank holds a
  shard of the sequence).

Parameters of those modules: 1/tp of their bytes (a row-wise module's bias whole). Collectives, per
microbatch: a row-wise module's output all-reduced in F, a column-wise module's input gradient
all-reduced in I (with sequence parallelism an all-gather and a reduce-scatter of the same bytes in
each), a gathered column-wise output all-gathered in F.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import fx

from zbcompile.passes import _fx
from zbcompile.passes._fx import TP_BYTES, TP_FLOPS
from zbcompile.passes.trace import ROLE_PARAM, TracedModel

COLWISE, ROWWISE = "colwise", "rowwise"


def style_kind(style: Any) -> str | None:
    """COLWISE, ROWWISE, or None (replicated, sequence-parallel norms) for a plan's value."""
    name = style if isinstance(style, str) else type(style).__name__
    lowered = name.lower()
    if "colwise" in lowered:
        return COLWISE
    if "rowwise" in lowered:
        return ROWWISE
    return None


def _gathers_output(style: Any) -> bool:
    """A column-wise style whose output is gathered whole (transformers' "..._gather_output",
    "colwise_rep"; `ColwiseParallel(output_layouts=Replicate())`)."""
    if isinstance(style, str):
        return "gather" in style or style.endswith("_rep")
    layouts = getattr(style, "output_layouts", None)
    return layouts is not None and all(getattr(p, "is_replicate", lambda: False)() for p in layouts)


@dataclass(frozen=True)
class TensorParallelShares:
    """The accounting of `annotate_shares`: `param_shares` (FQN -> share a rank holds, for
    sharded parameters), and per node name the bytes of each collective a microbatch runs:
    `forward_collectives` and `input_collectives` as (kind, bytes) with kind "all_reduce" or
    "all_gather" (a reduce-scatter counts as an all-gather: the same bytes on the wire)."""

    tp: int
    sequence_parallel: bool
    param_shares: dict[str, float] = field(default_factory=dict)
    forward_collectives: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    input_collectives: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def _module_of(node: fx.Node) -> str:
    return node.meta.get("custom", {}).get("module", "")


def _matches(pattern: str, fqn: str) -> bool:
    from fnmatch import fnmatch

    tokens, parts = pattern.split("."), fqn.split(".")
    return len(tokens) == len(parts) and all(fnmatch(p, t) for t, p in zip(tokens, parts))


def _owners(modules: set[str], plan: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Module FQN -> (the planned module holding it or itself, its style), for modules inside a
    planned column- or row-wise module."""
    planned: dict[str, Any] = {}
    for fqn in modules:
        parts = fqn.split(".")
        for length in range(len(parts), 0, -1):
            prefix = ".".join(parts[:length])
            style = next((s for p, s in plan.items() if style_kind(s) and _matches(p, prefix)), None)
            if style is not None:
                planned[fqn] = (prefix, style)
                break
    return planned


def annotate_shares(traced: TracedModel, plan: Mapping[str, Any], tp: int, sequence_parallel: bool = False):
    """Set each forward node's TP_FLOPS and TP_BYTES share (module docstring) and return the
    parameters' shares and the collectives; a plan naming no traced module is refused."""
    graph = traced.graph_module.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    owners = _owners({_module_of(n) for n in nodes} | {f.rpartition(".")[0] for f in traced.param_fqns}, plan)
    for pattern, style in plan.items():
        if style_kind(style) and not any(_matches(pattern, prefix) for prefix, _ in owners.values()):
            raise ValueError(
                f"plan(tensor_parallel=...): the plan names module {pattern!r}, which {type(traced.model).__name__} "
                f"does not have (tp={tp}); name its modules by their FQNs, with * for an index"
            )
    shares = TensorParallelShares(tp, sequence_parallel)
    part = 1.0 / tp
    for fqn in traced.param_fqns:
        owner = owners.get(fqn.rpartition(".")[0])
        if owner is not None and not (style_kind(owner[1]) == ROWWISE and fqn.endswith("bias")):
            shares.param_shares[fqn] = part
    calls = _calls(nodes, owners)
    region = _between_calls(calls)
    anchored = _anchored(graph)
    for node in nodes:
        owner = owners.get(_module_of(node))
        if owner is not None:
            kind = style_kind(owner[1])
            whole_bytes = kind == ROWWISE or (_gathers_output(owner[1]) and node in calls[owner[0]]["outputs"])
            _set(node, part, 1.0 if whole_bytes else part)
        elif node in region or (sequence_parallel and node in anchored):
            _set(node, part, part)
    for placeholder in graph.find_nodes(op="placeholder"):
        if placeholder.meta.get("zb_role") == ROLE_PARAM and placeholder.meta["zb_name"] in shares.param_shares:
            _set(placeholder, part, part)
    _collectives(calls, shares, anchored)
    return shares


def _set(node: fx.Node, flops: float, nbytes: float) -> None:
    node.meta["custom"] = {**node.meta.get("custom", {}), TP_FLOPS: flops, TP_BYTES: nbytes}


def _calls(nodes: list[fx.Node], owners: dict[str, tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per planned module: its style, its nodes, its activation inputs and its outputs (nodes read
    outside it)."""
    calls: dict[str, dict[str, Any]] = {}
    for node in nodes:
        owner = owners.get(_module_of(node))
        if owner is not None:
            calls.setdefault(owner[0], {"style": owner[1], "nodes": []})["nodes"].append(node)
    for call in calls.values():
        inside = set(call["nodes"])
        call["inputs"] = list(dict.fromkeys(
            a for n in call["nodes"] for a in n.all_input_nodes
            if a not in inside and a.meta.get("zb_role") != ROLE_PARAM and _fx.is_differentiable(a.meta.get("val"))
        ))
        call["outputs"] = [n for n in call["nodes"] if any(u not in inside for u in n.users)]
    return calls


def _between_calls(calls: dict[str, dict[str, Any]]) -> set[fx.Node]:
    """The nodes on a path from a column-wise module's output to a row-wise module's input that
    passes through no planned module."""
    inside = {n for call in calls.values() for n in call["nodes"]}
    after = _fx.descendants(
        u for c in calls.values() if style_kind(c["style"]) == COLWISE for n in c["outputs"] for u in n.users
    )
    before = set()
    frontier = [i for c in calls.values() if style_kind(c["style"]) == ROWWISE for i in c["inputs"]]
    while frontier:
        node = frontier.pop()
        if node in before or node in inside or node not in after:
            continue
        before.add(node)
        frontier.extend(node.all_input_nodes)
    return before


def _anchored(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from the model's inputs (activations), not from parameters alone."""
    seeds = [n for n in graph.find_nodes(op="placeholder") if n.meta.get("zb_role") in ("input", "target")]
    return _fx.descendants(seeds)


def _collectives(calls: dict[str, dict[str, Any]], shares: TensorParallelShares, anchored: set[fx.Node]) -> None:
    """Each planned module's collectives, on its first node computed from activations (module
    docstring; a stage runs that node)."""
    scattered = "all_gather" if shares.sequence_parallel else "all_reduce"
    for call in calls.values():
        first = next((n.name for n in call["nodes"] if n in anchored), None)
        if first is None:
            continue
        kind = style_kind(call["style"])
        if kind == COLWISE:
            input_bytes = sum(_fx.tensor_bytes(i.meta.get("val")) for i in call["inputs"])
            shares.input_collectives.setdefault(first, []).append((scattered, input_bytes))
            if shares.sequence_parallel:
                shares.forward_collectives.setdefault(first, []).append(("all_gather", input_bytes))
            if _gathers_output(call["style"]):
                output_bytes = sum(_fx.tensor_bytes(o.meta.get("val")) for o in call["outputs"])
                shares.forward_collectives.setdefault(first, []).append(("all_gather", output_bytes))
        else:
            output_bytes = sum(_fx.tensor_bytes(o.meta.get("val")) for o in call["outputs"])
            shares.forward_collectives.setdefault(first, []).append((scattered, output_bytes))
            if shares.sequence_parallel:
                shares.input_collectives.setdefault(first, []).append(("all_gather", output_bytes))


def split_mismatch(model: Any, plan: Mapping[str, Any], tp: int) -> str:
    """Why `tp` ranks cannot split `model` under `plan` ("" where they can): its config's heads
    or a planned module's weight whose split dimension (column-wise: the first, row-wise: the
    last) `tp` does not divide."""
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value % tp:
            return f"the config's {attribute}={value} is not a multiple of tp={tp}"
    for fqn, module in model.named_modules():
        style = next((s for p, s in plan.items() if style_kind(s) and _matches(p, fqn)), None)
        weight = getattr(module, "weight", None)
        if style is None or weight is None or weight.dim() == 0:
            continue
        dim = 0 if style_kind(style) == COLWISE else weight.dim() - 1
        if weight.shape[dim] % tp:
            return f"{fqn}.weight's dimension {dim} ({weight.shape[dim]}) is not a multiple of tp={tp}"
    return ""


def model_plan(model: Any, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The plan `tp` ranks split: `given`, or a transformers model's own (its config's
    `base_model_tp_plan` under the base model's prefix, and the head's)."""
    if given is not None:
        return dict(given)
    config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    own = {f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k: v for k, v in config_plan.items()}
    own.update(getattr(type(model), "_tp_plan", None) or {})
    if not own:
        raise ValueError(
            f"plan(tp=...): {type(model).__name__} has no tensor-parallel plan of its own; pass "
            "tensor_parallel={'<module pattern>': ColwiseParallel() or 'colwise', ...}"
        )
    return own
