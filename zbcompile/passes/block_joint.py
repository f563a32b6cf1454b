"""Pass: a stage's AOTAutograd joint graph assembled from its blocks' joints, each distinct block
exported once.

A stage of a deep model is mostly a run of identical blocks (a decoder's layers). `segments` cuts
the stage's graph, in its node order, into maximal runs of ops made by one block (a module whose FQN
holds an index: `model.layers.7`, `blocks.3`) and runs of the ops between blocks. Segments are
exported last first, as stages are (a segment's output gets a tangent exactly where a later segment,
or the next stage, returns a gradient for it); segments with equal fingerprints
(`graph_fingerprint.graph_fingerprint`, which inputs carry a gradient, which outputs receive one)
are exported once, the others take that joint under their own parameters. The joints are then
stitched: forward parts in segment order, backward parts in reverse order, each segment's tangents
read from the gradient the segment after it computed. Nodes are named afresh in order, as the
stage's own trace names them. The result is the joint `ti.export_joint` gives for the whole stage,
node for node (ops, arguments, shapes, names, descriptors; `tests/passes/test_block_joint.py` checks
it), so `joint._separate_forward` and every later pass treat it as they treat that one.

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
from typing import Any, Hashable

import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile.passes import _fx
from zbcompile.passes.graph_fingerprint import graph_fingerprint
from zbcompile.passes.joint_stitch import NotStitchable, Segment, stitch
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


def block_of(node: fx.Node) -> str | None:
    """The block an op belongs to: its module's FQN up to the first index (`model.layers.7`),
    None outside any indexed module."""
    parts = node.meta.get("custom", {}).get("module", "").split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return None


def _is_size(node: fx.Node) -> bool:
    """Arithmetic on symbolic sizes (`shape_symbols.py`): each segment that reads it computes it."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)


def segments(stage: Stage) -> list[list[fx.Node]]:
    """The stage's ops (call_function nodes, in graph order) cut into maximal runs made by one
    block, and runs between blocks; arithmetic on sizes belongs to no run (`_segment`)."""
    runs: list[list[fx.Node]] = []
    current: str | None = None
    for node in stage.module.graph.nodes:
        if node.op != "call_function" or _is_size(node):
            continue
        block = block_of(node)
        if not runs or block != current:
            runs.append([])
            current = block
        runs[-1].append(node)
    return runs


def _requires_grad(stage: Stage, partition: StagePartition) -> set[fx.Node]:
    """Nodes of the stage graph whose value may require grad: `_fx.requires_grad_closure` from
    the stage's differentiable inputs and trainable parameters (as the partition decided them)."""
    graph = stage.module.graph
    inputs = dict(zip(graph.find_nodes(op="placeholder"), stage.graph_inputs))
    seeds = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            info = partition.values.get(inputs[node])
            if info is not None and info.differentiable:
                seeds.add(node)
        elif node.op == "get_attr":
            value = _fx.get_attr_value(stage.module, node.target)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                seeds.add(node)
    return _fx.requires_grad_closure(graph, seeds)


def stitched_joint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], loss_name: str | None, fake_mode: Any,
    exported: dict[Hashable, Segment] | None = None,
) -> fx.GraphModule | None:
    """The whole stage's joint graph (as `ti.export_joint` of `joint._prepare_outputs`' module
    gives it) from its segments' joints, or None where that is not evidently exact (see the
    module docstring). `exported`: the segments exported so far, by key (fingerprint, which
    inputs carry a gradient, which outputs receive one); pass one dict for all stages of a
    partition, and a block alike in two stages is exported once."""
    try:
        return _stitched_joint(stage, partition, grads_from_next, loss_name, fake_mode, exported)
    except Exception:  # noqa: BLE001 - NotStitchable, or an error the whole stage's export reports, naming the stage
        return None


def _stitched_joint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], loss_name: str | None, fake_mode: Any,
    exported: dict[Hashable, Segment] | None,
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
    exported = {} if exported is None else exported
    _export_last_first(stage, partition, parts, returned, takes_grad, requires_grad, loss_name, fake_mode, exported)
    return stitch(stage, parts, returned, takes_grad, requires_grad)


def _export_last_first(
    stage: Stage, partition: StagePartition, parts: list[Segment], returned: list[fx.Node],
    takes_grad: dict[fx.Node, bool], requires_grad: set[fx.Node], loss_name: str | None, fake_mode: Any,
    exported: dict[Hashable, Segment],
) -> None:
    """Each segment's joint, last first (a segment's output wants a gradient where a later
    segment returns one for it), exported once per key and reused by the segments alike (in
    this stage or, through `exported`, in others)."""
    graph = stage.module.graph
    segment_of = {n: k for k, part in enumerate(parts) for n in part.nodes}
    roots = _fx.storage_roots(graph)
    placeholder_names = dict(zip(graph.find_nodes(op="placeholder"), stage.graph_inputs))
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
            and (n.op != "placeholder" or getattr(partition.values.get(placeholder_names[n]), "differentiable", False))
            for n in part.inputs
        )
        part.module = _segment_module(part, stage.module)
        fingerprint = graph_fingerprint(part.module, constants_by_value=True)
        key = (fingerprint, part.differentiable, part.wants_grad, loss_name is not None and returned[0] in part.outputs)
        first = exported.get(key)
        if first is None:
            examples = tuple(
                ti.fake_strided(fake_mode, v.shape, v.stride(), v.dtype, v.device).requires_grad_(d)
                if isinstance(v, torch.Tensor) else v  # a symbolic size (`shape_symbols.py`)
                for v, d in ((n.meta["val"], d) for n, d in zip(part.inputs, part.differentiable))
            )
            part.joint = ti.export_joint(part.module, examples)
            part.targets = {a.target: a.target for a in part.attributes}
            part.joint_index = len(exported)
            exported[key] = part
        else:
            part.joint, part.joint_index = first.joint, first.joint_index
            source, mine = block_of(first.nodes[0]), block_of(part.nodes[0])
            part.renamed_module = (source, mine) if source and mine and source != mine else None
            part.targets = {
                mine.target: theirs.target for mine, theirs in zip(first.attributes, part.attributes, strict=True)
            }
        for desc in part.joint.graph.output_node().meta["desc"]:
            if desc is not None and not isinstance(desc, (ti.PlainAOTOutput, ti.GradAOTOutput)):
                raise NotStitchable(f"joint output {desc}")
        for node, desc in zip(part.joint.graph.output_node().args[0], part.joint.graph.output_node().meta["desc"]):
            if isinstance(desc, ti.GradAOTOutput) and isinstance(desc.grad_of, ti.PlainAOTInput) and node is not None:
                grad_of_input[(k, part.inputs[desc.grad_of.idx])] = True


def _segment(run: list[fx.Node], segment_of: dict[fx.Node, int], k: int, returned: list[fx.Node]) -> Segment:
    sizes: dict[fx.Node, None] = {}  # the arithmetic on sizes the run reads, and what that reads of it
    frontier = [a for n in run for a in n.all_input_nodes if _is_size(a)]
    while frontier:
        node = frontier.pop()
        if node not in sizes:
            sizes[node] = None
            frontier.extend(a for a in node.all_input_nodes if _is_size(a))
    order = {n: i for i, n in enumerate(run[0].graph.nodes)}
    run = sorted(sizes, key=order.__getitem__) + run
    own = set(run)
    inputs: dict[fx.Node, None] = {}
    attributes: dict[fx.Node, None] = {}
    for node in run:
        for a in node.all_input_nodes:
            if a in own:
                continue
            (attributes if a.op == "get_attr" else inputs)[a] = None
    outputs = [
        n for n in run if not _is_size(n) and (n in returned or any(segment_of.get(u, k) != k for u in n.users))
    ]
    return Segment(run, list(inputs), list(attributes), outputs)


def _repeats(parts: list[Segment], root: fx.GraphModule) -> bool:
    """Whether two segments have the same graph (what they read aside): otherwise stitching
    would export as many graphs as the stage's own export, and more."""
    seen: set[Hashable] = set()
    for part in parts:
        key = graph_fingerprint(_segment_module(part, root), constants_by_value=True)
        if key in seen:
            return True
        seen.add(key)
    return False


def _refuse_shared(parts: list[Segment], requires_grad: set[fx.Node]) -> None:
    """A parameter or differentiable value two segments read gets its gradients added where
    autograd's engine finishes a backward function, which the segments' joints do not show."""
    readers: dict[fx.Node, int] = {}
    for part in parts:
        for node in [*part.inputs, *part.attributes]:
            if node in requires_grad:
                readers[node] = readers.get(node, 0) + 1
                if readers[node] > 1:
                    raise NotStitchable(f"{node.name} is read by two segments")


def _segment_module(part: Segment, root: fx.GraphModule) -> fx.GraphModule:
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
    return _fx.finish(graph, root, name="Segment", read_only=True)
