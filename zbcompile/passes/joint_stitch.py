"""Stitching: a stage's joint graph from its segments' joints (`block_joint` cuts the stage into
segments and exports each distinct one once).

Forward parts are copied in segment order, backward parts in reverse order, each segment's tangents
read from the gradient the segment after it computed; placeholders and outputs are laid out in
AOTAutograd's order and nodes named afresh in order, as the stage's own trace names them, so the
result is the joint `ti.export_joint` gives for the whole stage, node for node. `NotStitchable`
is raised wherever a segment's joint shows something the stitch cannot reproduce exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile.passes import _fx
from zbcompile.passes.partition import Stage


class NotStitchable(Exception):
    """The stage's joint is not evidently the stitch of its segments' joints (see module doc)."""


@dataclass
class Segment:
    """One run of a stage's ops as a module of its own: `inputs` (nodes of the stage graph it
    reads, by first use), `params` (the get_attr nodes it reads), `outputs` (its nodes read
    after it), and what its export needs and gives."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    attributes: list[fx.Node]
    outputs: list[fx.Node]
    module: fx.GraphModule | None = None
    differentiable: tuple[bool, ...] = ()
    wants_grad: tuple[bool, ...] = ()
    detach: tuple[bool, ...] = ()  # per output, whether the segment returns it detached
    joint: fx.GraphModule | None = None
    targets: dict[str, str] | None = None  # the joint's attribute targets -> this segment's
    joint_index: int = 0  # which of the stage's distinct joints
    # a joint exported for another block alike: (that block's FQN, this one's), so that the ops'
    # module (`meta["custom"]["module"]`: errors, per-block costs) names this segment's block
    renamed_module: tuple[str, str] | None = None


def forward_region(joint: fx.GraphModule) -> set[fx.Node]:
    """The joint's nodes traced before its backward: up to the last node its forward outputs
    need (and that node's tuple elements)."""
    output = joint.graph.output_node()
    forward_outputs = [n for n, d in zip(output.args[0], output.meta["desc"]) if isinstance(d, ti.PlainAOTOutput)]
    needed = _fx.ancestors(forward_outputs)
    nodes = list(joint.graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n in needed), default=-1)
    while (
        last + 1 < len(nodes)
        and getattr(nodes[last + 1].target, "__name__", "") == "getitem"
        and nodes[last + 1].args[0] in needed
    ):
        last += 1
    return {n for n in nodes[: last + 1] if n.op != "placeholder"}


def stitch(
    stage: Stage, parts: list[Segment], returned: list[fx.Node], takes_grad: dict[fx.Node, bool],
    requires_grad: set[fx.Node],
) -> fx.GraphModule:
    """The whole stage's joint from its segments' (see the module docstring)."""
    graph = fx.Graph()
    state, env, tangent_of = _stitch_placeholders(graph, stage, parts, returned, takes_grad, requires_grad)
    copies, forward_out = _stitch_forwards(graph, parts, returned, state, env)
    grad_of, param_grads = _stitch_backwards(graph, parts, copies, returned, tangent_of)

    # outputs, in AOTAutograd's order: the stage's outputs, then a gradient (or None) per primal
    outputs: list[fx.Node | None] = [forward_out[n] for n in returned]
    descs: list[Any] = [ti.PlainAOTOutput(i) for i in range(len(returned))]
    grads = [(param_grads.get(name), ti.ParamAOTInput(name)) for name in state]  # buffers: None
    inputs = stage.module.graph.find_nodes(op="placeholder")
    grads += [(grad_of.get(node), ti.PlainAOTInput(i)) for i, node in enumerate(inputs)]
    for grad, of in grads:
        outputs.append(grad)
        descs.append(None if grad is None else ti.GradAOTOutput(of))
    graph.output(list(outputs))
    graph.output_node().meta["desc"] = descs
    return _fx.finish(graph, _constants(parts), name=type(stage.module).__name__, read_only=True)


def _stitch_placeholders(
    graph: fx.Graph, stage: Stage, parts: list[Segment], returned: list[fx.Node], takes_grad: dict[fx.Node, bool],
    requires_grad: set[fx.Node],
) -> tuple[dict[str, fx.Node], dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """The stitched graph's placeholders, in AOTAutograd's order (parameters, buffers, the
    stage's inputs, tangents): (state by FQN, the stage's inputs by stage graph node, tangents
    by stage output)."""
    module = stage.module
    val_of: dict[str, Any] = {}
    for part in parts:
        for node in part.joint.graph.find_nodes(op="placeholder"):
            desc = node.meta["desc"]
            if isinstance(desc, (ti.ParamAOTInput, ti.BufferAOTInput)):
                val_of.setdefault(part.targets[desc.target], node.meta.get("val"))
    state: dict[str, fx.Node] = {}
    for name, _ in module.named_parameters():
        state[name] = _placeholder(graph, f"primals_{len(state) + 1}", ti.ParamAOTInput(name), val_of.get(name))
    for name, _ in module.named_buffers():
        state[name] = _placeholder(graph, f"primals_{len(state) + 1}", ti.BufferAOTInput(name), val_of.get(name))
    if any(val_of.get(name) is None for name in state) or set(val_of) - set(state):
        raise NotStitchable("state the segments read that the stage does not hold, or none reads")

    stage_placeholders = list(module.graph.find_nodes(op="placeholder"))
    env: dict[fx.Node, fx.Node] = {}  # stage graph node -> its value in the stitched graph
    input_vals = _plain_input_vals(parts, stage_placeholders)
    for i, node in enumerate(stage_placeholders):
        val = input_vals.get(node, node.meta.get("val"))
        env[node] = _placeholder(graph, f"primals_{len(state) + i + 1}", ti.PlainAOTInput(i), val)
    tangent_of: dict[fx.Node, fx.Node] = {}  # stage output -> its tangent placeholder
    for i, node in enumerate(returned):
        if takes_grad[node] and node in requires_grad:
            part = next(p for p in parts if node in p.outputs)
            val = _tangent_val(part, part.outputs.index(node))
            name = f"tangents_{len(tangent_of) + 1}"
            tangent_of[node] = _placeholder(graph, name, ti.TangentAOTInput(ti.PlainAOTOutput(i)), val)
    return state, env, tangent_of


def _stitch_forwards(
    graph: fx.Graph, parts: list[Segment], returned: list[fx.Node], state: dict[str, fx.Node],
    env: dict[fx.Node, fx.Node],
) -> tuple[list[dict[fx.Node, fx.Node]], dict[fx.Node, fx.Node]]:
    """The segments' forward regions copied in segment order (`env` gains each segment's
    outputs): (per segment, its joint's nodes -> their copies; stage graph node -> its forward
    value, a returned output detached after all forward ops as the stage's export does)."""
    copies: list[dict[fx.Node, fx.Node]] = []
    forward_out: dict[fx.Node, fx.Node] = {}  # stage graph node -> the segment's output
    detached_meta: dict[fx.Node, dict] = {}  # stage outputs returned detached -> the detach's meta
    for part in parts:
        joint = part.joint.graph
        local: dict[fx.Node, fx.Node] = {}
        for node in joint.find_nodes(op="placeholder"):
            desc = node.meta["desc"]
            if isinstance(desc, (ti.ParamAOTInput, ti.BufferAOTInput)):
                local[node] = state[part.targets[desc.target]]
            elif isinstance(desc, ti.PlainAOTInput):
                local[node] = env[part.inputs[desc.idx]]
        forward = forward_region(part.joint)
        output = joint.output_node()
        # the segment's detaches are left out: later segments read the value itself, and the
        # stage's export detaches a stage output after all its forward ops
        detaches = {
            value: part.outputs[desc.idx]
            for value, desc in zip(output.args[0], output.meta["desc"])
            if isinstance(desc, ti.PlainAOTOutput) and part.detach[desc.idx]
        }
        detach = torch.ops.aten.detach.default
        if any(v.op != "call_function" or v.target is not detach or len(v.users) > 1 for v in detaches):
            raise NotStitchable("a detached output the joint reads")
        _copy(graph, [n for n in joint.nodes if n in forward and n not in detaches], local, part)
        for value, desc in zip(output.args[0], output.meta["desc"]):
            if isinstance(desc, ti.PlainAOTOutput):
                node = part.outputs[desc.idx]
                env[node] = forward_out[node] = local[value.args[0] if value in detaches else value]
                if value in detaches:
                    detached_meta[node] = value.meta
        copies.append(local)
    for node in returned:
        if node in detached_meta:
            forward_out[node] = graph.create_node(
                "call_function", torch.ops.aten.detach.default, (forward_out[node],), name="detach"
            )
            forward_out[node].meta = dict(detached_meta[node])
    return copies, forward_out


def _stitch_backwards(
    graph: fx.Graph, parts: list[Segment], copies: list[dict[fx.Node, fx.Node]], returned: list[fx.Node],
    tangent_of: dict[fx.Node, fx.Node],
) -> tuple[dict[fx.Node, fx.Node], dict[str, fx.Node]]:
    """The segments' backward regions copied in reverse segment order, a segment's tangent being
    the gradient its reader computed: (stage graph node -> its gradient, FQN -> its gradient)."""
    grad_of: dict[fx.Node, fx.Node] = {}  # stage graph node -> its gradient in the stitched graph
    param_grads: dict[str, fx.Node] = {}
    for part, local in reversed(list(zip(parts, copies))):
        joint = part.joint.graph
        for node in joint.find_nodes(op="placeholder"):
            desc = node.meta["desc"]
            if isinstance(desc, ti.TangentAOTInput):
                if not isinstance(desc.output, ti.PlainAOTOutput):
                    raise NotStitchable(f"tangent {desc}")
                out = part.outputs[desc.output.idx]
                grad = tangent_of.get(out) if out in returned else grad_of.get(out)
                if grad is None or not _same_layout(grad, node):
                    raise NotStitchable(f"the gradient of {out.name} differs from its tangent")
                local[node] = grad
        forward = forward_region(part.joint)
        output = joint.output_node()
        grad_outputs: dict[fx.Node, tuple[dict, Any]] = {}  # the joint's gradient -> where it goes
        for value, desc in zip(output.args[0], output.meta["desc"]):
            if isinstance(desc, ti.GradAOTOutput) and value is not None:
                of = desc.grad_of
                if isinstance(of, ti.PlainAOTInput):
                    grad_outputs[value] = (grad_of, part.inputs[of.idx])
                elif isinstance(of, ti.ParamAOTInput):
                    grad_outputs[value] = (param_grads, part.targets[of.target])

        _copy(graph, [n for n in joint.nodes if n.op == "call_function" and n not in forward], local, part)
        for node, (into, key) in grad_outputs.items():
            into[key] = local[node]
    return grad_of, param_grads


def _placeholder(graph: fx.Graph, name: str, desc: Any, val: Any) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = {"desc": desc, "val": val}
    return node


def _plain_input_vals(parts: list[Segment], stage_placeholders: list[fx.Node]) -> dict[fx.Node, Any]:
    vals = {}
    for part in parts:
        for node in part.joint.graph.find_nodes(op="placeholder"):
            desc = node.meta["desc"]
            if isinstance(desc, ti.PlainAOTInput) and part.inputs[desc.idx] in stage_placeholders:
                vals.setdefault(part.inputs[desc.idx], node.meta.get("val"))
    return vals


def _tangent_val(part: Segment, index: int) -> Any:
    for node in part.joint.graph.find_nodes(op="placeholder"):
        desc = node.meta["desc"]
        if isinstance(desc, ti.TangentAOTInput) and getattr(desc.output, "idx", None) == index:
            return node.meta.get("val")
    raise NotStitchable("an output without its tangent")


def _same_layout(grad: fx.Node, tangent: fx.Node) -> bool:
    a, b = grad.meta.get("val"), tangent.meta.get("val")
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return tensors and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node], part: Segment) -> None:
    """Append `nodes` to `graph` (reading through `env`), named by their ops in order."""
    for node in nodes:
        if node.op == "get_attr":
            env[node] = graph.get_attr(_constant_name(part, node.target))
            env[node].meta = dict(node.meta)
        else:  # named afresh, as the whole stage's trace names its nodes (by op, in order)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            packet = getattr(node.target, "overloadpacket", None)
            name = packet.__name__ if packet is not None else None
            env[node] = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
            env[node].meta = _own_meta(node.meta, part.renamed_module)


def _own_meta(meta: dict, renamed: tuple[str, str] | None) -> dict:
    """A copy of a joint node's `meta`, its module under this segment's block (`renamed`)."""
    meta = dict(meta)
    module = meta.get("custom", {}).get("module")
    if renamed is not None and module is not None:
        old, new = renamed
        if module == old or module.startswith(old + "."):
            meta["custom"] = {**meta["custom"], "module": new + module[len(old):]}
    return meta


def _constant_name(part: Segment, target: str) -> str:
    return f"_segment{part.joint_index}_{target}"


def _constants(parts: list[Segment]) -> dict[str, Any]:
    """The joints' own attributes (tensor constants AOTAutograd made), under names unique per joint."""
    root = {}
    for part in parts:
        for node in part.joint.graph.find_nodes(op="get_attr"):
            root[_constant_name(part, node.target)] = _fx.get_attr_value(part.joint, node.target)
    return root
