"""Pass: a stage's AOTAutograd joint graph assembled from its blocks' joints, each distinct block
exported once.

A stage of a deep model is mostly a run of identical blocks (a decoder's layers). `segments`
cuts the stage's graph, in its node order, into maximal runs of ops made by one block (a module
whose FQN holds an index: `model.layers.7`, `blocks.3`) and runs of the ops between blocks.
Segments are exported last first, as stages are (a segment's output gets a tangent exactly
where a later segment, or the next stage, returns a gradient for it); segments with equal
fingerprints (`graph_fingerprint.graph_fingerprint`, which inputs carry a gradient, which outputs
receive one) are exported once, the others take that joint under their own parameters. The
joints are then stitched: forward parts in segment order, backward parts in reverse order, each
segment's tangents read from the gradient the segment after it computed. Nodes are named afresh in order, as the stage's own
trace names them. The result is the joint `ti.export_joint` gives for the whole stage, node for
node (ops, arguments, shapes, names, descriptors; `tests/passes/test_block_joint.py` checks it),
so `joint._separate_forward` and every later pass treat it as they treat that one.

`stitched_joint` answers None, and the stage is exported whole, wherever that equality is not
evident from the graph: no two segments alike, buffer updates, checkpoint regions, a parameter
or differentiable value two segments read (a tied weight: autograd adds its gradients where a
backward function ends, which the segments' joints do not show), a value
crossing between segments that is not a tensor, is a differentiable view or is the result of
an op outside `_BOUNDARY_OPS` (a residual sum, a matmul, an embedding pass), a stage output
read by a later segment too, a gradient whose strides differ from the tangent it feeds, or a
joint AOTAutograd gives anything else than plain outputs and gradients for (an error the
stage's own export then reports).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile.passes import _fx
from zbcompile.passes.graph_fingerprint import graph_fingerprint
from zbcompile.passes.partition import Stage, StagePartition

_INDEX = re.compile(r"^\d+$")
# ops whose differentiable result may cross between segments: their backward does not read their
# own result (an op's result that autograd saves, tanh's say, is traced through a detach in the
# stage's own joint, which a segment returning it does not show)
_BOUNDARY_OPS = frozenset({
    torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.embedding.default,
})
_CHECKPOINT = "checkpoint"


class NotStitchable(Exception):
    """The stage's joint is not evidently the stitch of its segments' joints (see module doc)."""


def block_of(node: fx.Node) -> str | None:
    """The block an op belongs to: its module's FQN up to the first index (`model.layers.7`),
    None outside any indexed module."""
    parts = node.meta.get("custom", {}).get("module", "").split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return None


def segments(stage: Stage) -> list[list[fx.Node]]:
    """The stage's ops (call_function nodes, in graph order) cut into maximal runs made by one
    block, and runs between blocks."""
    runs: list[list[fx.Node]] = []
    current: str | None = None
    for node in stage.module.graph.nodes:
        if node.op != "call_function":
            continue
        block = block_of(node)
        if not runs or block != current:
            runs.append([])
            current = block
        runs[-1].append(node)
    return runs


@dataclass
class _Segment:
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


def _requires_grad(stage: Stage, partition: StagePartition) -> set[fx.Node]:
    """Nodes of the stage graph whose value may require grad (as `partition._requires_grad`,
    from the stage's differentiable inputs and trainable parameters)."""
    result: set[fx.Node] = set()
    inputs = dict(zip(stage.module.graph.find_nodes(op="placeholder"), stage.graph_inputs))
    for node in stage.module.graph.nodes:
        if node.op == "placeholder":
            info = partition.values.get(inputs[node])
            if info is not None and info.differentiable:
                result.add(node)
        elif node.op == "get_attr":
            value = _fx.get_attr_value(stage.module, node.target)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                result.add(node)
        elif node.op == "call_function" and node.target is not torch.ops.aten.detach.default:
            value = node.meta.get("val")
            if (isinstance(value, (tuple, list)) or _fx.is_differentiable(value)) and any(
                a in result for a in node.all_input_nodes
            ):
                result.add(node)
    return result


def stitched_joint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], loss_name: str | None, fake_mode: Any
) -> fx.GraphModule | None:
    """The whole stage's joint graph (as `ti.export_joint` of `joint._prepare_outputs`' module
    gives it) from its segments' joints, or None where that is not evidently exact (see the
    module docstring)."""
    try:
        return _stitched_joint(stage, partition, grads_from_next, loss_name, fake_mode)
    except NotStitchable:
        return None
    except Exception:  # noqa: BLE001 - the whole stage's export reports it, naming the stage
        return None


def _stitched_joint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], loss_name: str | None, fake_mode: Any
) -> fx.GraphModule:
    graph = stage.module.graph
    if stage.buffer_updates:
        raise NotStitchable("buffer updates")
    if any(n.meta.get("custom", {}).get(_CHECKPOINT) is not None for n in graph.nodes):
        raise NotStitchable("checkpoint regions")
    runs = segments(stage)
    blocks = [block_of(run[0]) for run in runs]
    if not any(b is not None for b in blocks) or len(runs) < 2:
        raise NotStitchable("no blocks")
    requires_grad = _requires_grad(stage, partition)
    segment_of = {n: k for k, run in enumerate(runs) for n in run}
    returned = list(graph.output_node().args[0])
    if len(returned) != len(stage.graph_outputs):
        raise NotStitchable("buffer updates")
    parts = [_segment(run, segment_of, k, returned) for k, run in enumerate(runs)]
    _refuse_shared(parts, requires_grad)
    if not _repeats(parts, stage.module):
        raise NotStitchable("no block repeats")

    # which stage outputs take a gradient: `_prepare_outputs` detaches the others (the last stage's: none)
    takes_grad = {
        node: loss_name is not None or stage.graph_outputs[i] in grads_from_next for i, node in enumerate(returned)
    }
    if any(n.op != "call_function" for n in returned):
        raise NotStitchable("a stage output computed outside the segments")
    roots = _fx.storage_roots(graph)
    placeholder_names = dict(zip(graph.find_nodes(op="placeholder"), stage.graph_inputs))
    exported: dict[Hashable, _Segment] = {}
    grad_of_input: dict[tuple[int, fx.Node], bool] = {}  # (segment, input node) -> gets a gradient
    for k in reversed(range(len(parts))):
        part = parts[k]
        wants = []
        for node in part.outputs:
            users = {segment_of[u] for u in node.users if u in segment_of}
            if node in takes_grad:
                if users and node in requires_grad:
                    raise NotStitchable(f"stage output {node.name} is read by a later segment too")
                wants.append(takes_grad[node] and node in requires_grad)
            else:
                wants.append(any(grad_of_input.get((s, node), False) for s in users))
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise NotStitchable(f"segment output {node.name} is not a tensor")
            if roots[node] is not node and (node in requires_grad or roots[node] not in part.nodes):
                raise NotStitchable(f"segment output {node.name} is a view")
            if node in requires_grad and node not in takes_grad and node.target not in _BOUNDARY_OPS:
                raise NotStitchable(f"segment output {node.name} is computed by {node.target}")
        part.wants_grad = tuple(wants)
        part.detach = tuple(
            not takes_grad[n] if n in takes_grad else n in requires_grad and not w for n, w in zip(part.outputs, wants)
        )
        part.differentiable = tuple(
            n in requires_grad
            and (n.op != "placeholder" or (placeholder_names[n] in partition.values and partition.values[placeholder_names[n]].differentiable))
            for n in part.inputs
        )
        part.module = _segment_module(part, stage.module)
        key = (graph_fingerprint(part.module, constants_by_value=True), part.differentiable, part.wants_grad, loss_name is not None and returned[0] in part.outputs)
        first = exported.get(key)
        if first is None:
            examples = tuple(
                ti.fake_strided(fake_mode, v.shape, v.stride(), v.dtype, v.device).requires_grad_(d)
                for v, d in ((n.meta["val"], d) for n, d in zip(part.inputs, part.differentiable))
            )
            part.joint = ti.export_joint(part.module, examples)
            part.targets = {a.target: a.target for a in part.attributes}
            part.joint_index = len(exported)
            exported[key] = part
        else:
            part.joint, part.joint_index = first.joint, first.joint_index
            part.targets = {mine.target: theirs.target for mine, theirs in zip(first.attributes, part.attributes, strict=True)}
        for desc in part.joint.graph.output_node().meta["desc"]:
            if desc is not None and not isinstance(desc, (ti.PlainAOTOutput, ti.GradAOTOutput)):
                raise NotStitchable(f"joint output {desc}")
        for node, desc in zip(part.joint.graph.output_node().args[0], part.joint.graph.output_node().meta["desc"]):
            if isinstance(desc, ti.GradAOTOutput) and isinstance(desc.grad_of, ti.PlainAOTInput) and node is not None:
                grad_of_input[(k, part.inputs[desc.grad_of.idx])] = True
    return _stitch(stage, parts, returned, takes_grad, requires_grad)


def _segment(run: list[fx.Node], segment_of: dict[fx.Node, int], k: int, returned: list[fx.Node]) -> _Segment:
    own = set(run)
    inputs: dict[fx.Node, None] = {}
    attributes: dict[fx.Node, None] = {}
    for node in run:
        for a in node.all_input_nodes:
            if a in own:
                continue
            (attributes if a.op == "get_attr" else inputs)[a] = None
    outputs = [n for n in run if n in returned or any(segment_of.get(u, k) != k for u in n.users)]
    return _Segment(run, list(inputs), list(attributes), outputs)


def _repeats(parts: list[_Segment], root: fx.GraphModule) -> bool:
    """Whether two segments have the same graph (what they read aside): otherwise stitching
    would export as many graphs as the stage's own export, and more."""
    seen: set[Hashable] = set()
    for part in parts:
        key = graph_fingerprint(_segment_module(part, root), constants_by_value=True)
        if key in seen:
            return True
        seen.add(key)
    return False


def _refuse_shared(parts: list[_Segment], requires_grad: set[fx.Node]) -> None:
    """A parameter or differentiable value two segments read gets its gradients added where
    autograd's engine finishes a backward function, which the segments' joints do not show."""
    readers: dict[fx.Node, int] = {}
    for part in parts:
        for node in [*part.inputs, *part.attributes]:
            if node in requires_grad:
                readers[node] = readers.get(node, 0) + 1
                if readers[node] > 1:
                    raise NotStitchable(f"{node.name} is read by two segments")


def _segment_module(part: _Segment, root: fx.GraphModule) -> fx.GraphModule:
    """The segment as a module: placeholders for its inputs, the stage's attributes, its ops;
    outputs that take no gradient but may require one are detached (as `_prepare_outputs`)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(part.inputs):
        env[node] = graph.placeholder(f"segment_input_{i}")
        env[node].meta = dict(node.meta)
    for node in part.attributes:
        env[node] = graph.get_attr(node.target)
        env[node].meta = dict(node.meta)
    _fx.copy_nodes(graph, part.nodes, env)
    outputs = []
    for i, node in enumerate(part.outputs):
        value = env[node]
        if part.detach and part.detach[i]:
            value = graph.call_function(torch.ops.aten.detach.default, (value,))
        outputs.append(value)
    graph.output(tuple(outputs))
    return _fx.finish(graph, root, name="Segment")


def _forward_region(joint: fx.GraphModule) -> set[fx.Node]:
    """The joint's nodes traced before its backward: up to the last node its forward outputs
    need (and that node's tuple elements)."""
    output = joint.graph.output_node()
    forward_outputs = [n for n, d in zip(output.args[0], output.meta["desc"]) if isinstance(d, ti.PlainAOTOutput)]
    needed = _fx.ancestors(forward_outputs)
    nodes = list(joint.graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n in needed), default=-1)
    while last + 1 < len(nodes) and getattr(nodes[last + 1].target, "__name__", "") == "getitem" and nodes[last + 1].args[0] in needed:
        last += 1
    return {n for n in nodes[: last + 1] if n.op != "placeholder"}


def _stitch(
    stage: Stage, parts: list[_Segment], returned: list[fx.Node], takes_grad: dict[fx.Node, bool], requires_grad: set[fx.Node]
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
    grads += [(grad_of.get(node), ti.PlainAOTInput(i)) for i, node in enumerate(stage.module.graph.find_nodes(op="placeholder"))]
    for grad, of in grads:
        outputs.append(grad)
        descs.append(None if grad is None else ti.GradAOTOutput(of))
    graph.output(list(outputs))
    graph.output_node().meta["desc"] = descs
    return _fx.finish(graph, _constants(parts), name=type(stage.module).__name__)


def _stitch_placeholders(
    graph: fx.Graph,
    stage: Stage,
    parts: list[_Segment],
    returned: list[fx.Node],
    takes_grad: dict[fx.Node, bool],
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
        env[node] = _placeholder(graph, f"primals_{len(state) + i + 1}", ti.PlainAOTInput(i), input_vals.get(node, node.meta.get("val")))
    tangent_of: dict[fx.Node, fx.Node] = {}  # stage output -> its tangent placeholder
    for i, node in enumerate(returned):
        if takes_grad[node] and node in requires_grad:
            part = next(p for p in parts if node in p.outputs)
            val = _tangent_val(part, part.outputs.index(node))
            name = f"tangents_{len(tangent_of) + 1}"
            tangent_of[node] = _placeholder(graph, name, ti.TangentAOTInput(ti.PlainAOTOutput(i)), val)
    return state, env, tangent_of


def _stitch_forwards(
    graph: fx.Graph, parts: list[_Segment], returned: list[fx.Node], state: dict[str, fx.Node], env: dict[fx.Node, fx.Node]
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
        forward = _forward_region(part.joint)
        output = joint.output_node()
        # the segment's detaches are left out: later segments read the value itself, and the
        # stage's export detaches a stage output after all its forward ops
        detaches = {
            value: part.outputs[desc.idx]
            for value, desc in zip(output.args[0], output.meta["desc"])
            if isinstance(desc, ti.PlainAOTOutput) and part.detach[desc.idx]
        }
        if any(v.op != "call_function" or v.target is not torch.ops.aten.detach.default or len(v.users) > 1 for v in detaches):
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
            forward_out[node] = graph.create_node("call_function", torch.ops.aten.detach.default, (forward_out[node],), name="detach")
            forward_out[node].meta = dict(detached_meta[node])
    return copies, forward_out


def _stitch_backwards(
    graph: fx.Graph,
    parts: list[_Segment],
    copies: list[dict[fx.Node, fx.Node]],
    returned: list[fx.Node],
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
        forward = _forward_region(part.joint)
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


def _plain_input_vals(parts: list[_Segment], stage_placeholders: list[fx.Node]) -> dict[fx.Node, Any]:
    vals = {}
    for part in parts:
        for node in part.joint.graph.find_nodes(op="placeholder"):
            desc = node.meta["desc"]
            if isinstance(desc, ti.PlainAOTInput) and part.inputs[desc.idx] in stage_placeholders:
                vals.setdefault(part.inputs[desc.idx], node.meta.get("val"))
    return vals


def _tangent_val(part: _Segment, index: int) -> Any:
    for node in part.joint.graph.find_nodes(op="placeholder"):
        desc = node.meta["desc"]
        if isinstance(desc, ti.TangentAOTInput) and getattr(desc.output, "idx", None) == index:
            return node.meta.get("val")
    raise NotStitchable("an output without its tangent")


def _same_layout(grad: fx.Node, tangent: fx.Node) -> bool:
    a, b = grad.meta.get("val"), tangent.meta.get("val")
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    )


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node], part: _Segment) -> None:
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
            env[node].meta = dict(node.meta)


def _constant_name(part: _Segment, target: str) -> str:
    return f"_segment{part.joint_index}_{target}"


def _constants(parts: list[_Segment]) -> dict[str, Any]:
    """The joints' own attributes (tensor constants AOTAutograd made), under names unique per joint."""
    root = {}
    for part in parts:
        for node in part.joint.graph.find_nodes(op="get_attr"):
            root[_constant_name(part, node.target)] = _fx.get_attr_value(part.joint, node.target)
    return root
