"""Pass 3: per stage, the AOTAutograd joint graph, separated into a forward graph F and one
backward graph.

The graphs read and return values named as `value_names` describes (`param:<fqn>`, `in:<value>`,
`saved:<node>`, `tangent:<value>`, `grad:<value>`, ...); `program.Program` is a graph with those
names.

Parameter views (`t(weight)`) are recomputed where needed rather than saved.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import fx

from zbcompile import _torch_internals as ti
from zbcompile.passes import _fx, tensor_parallel
from zbcompile.passes.block_joint import stitched_joint
from zbcompile.passes.partition import Stage, StagePartition
from zbcompile.passes.program import Program, Signature
from zbcompile.passes.recompute import checkpointed_nodes, recompute_closure, recompute_when_needed
from zbcompile.passes.trace_errors import first_line, node_location, same_kind
from zbcompile.value_names import (
    GRAD,
    INPUT,
    OUTPUT,
    STATE,
    TANGENT,
    UPDATE,
    buffer_name,
    fqn_of,
    grad_name,
    input_name,
    is_param_grad,
    is_state,
    output_name,
    param_grad_name,
    param_name,
    saved_name,
    tangent_name,
    update_name,
)


@dataclass(frozen=True)
class StageJoint:
    """F and the whole backward of one stage.

    forward: inputs are the parameters and buffers it reads and every `in:` value; outputs are
        the `out:` values, the `update:` values, then the `saved:` activations. backward: reads
        parameters, buffers (`update:<fqn>` for those F updates), `saved:` values, `in:` values
        it needs and the `tangent:`s; returns `grad:<value>` for each stage input that gets a
        gradient, then `grad:param:<fqn>` for each parameter.
    tangents: the stage outputs its graphs take a gradient for (`tangent:` names in the backward).
    output_grads: every stage output whose gradient arrives from the next stage: the tangents
        and relayed values (in `Stage.outputs` order); the messages of the backward carry these.
    recomputed: names of the forward nodes the backward computes again instead of reading them
        saved (checkpoint regions, see `recompute.py`); the backward's copies keep these names.
    alternatives: the same stage separated with more recomputation, one per level asked for.
    """

    stage: int
    forward: Program
    backward: Program
    tangents: tuple[str, ...]
    input_grads: tuple[str, ...]
    param_grads: tuple[str, ...]
    storage: dict[str, tuple[str, int]]
    output_grads: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()
    alternatives: tuple["StageJoint", ...] = ()
    partial_grads: tuple[str, ...] = ()  # parameters whose gradient is a partial sum over "tp" (tensor_parallel.py)

    def held_bytes(self, names: Iterable[str]) -> int:
        """Bytes of memory the values `names` keep alive (views of one tensor counted once)."""
        roots = dict(self.storage[n] for n in names if n in self.storage)
        return sum(roots.values())


def export_stage_joints(
    partition: StagePartition, fake_mode, loss_name: str = "loss",
    recompute_levels: Sequence[Callable[[fx.Node], bool]] = (), reuse_blocks: bool = False,
) -> tuple[StageJoint, ...]:
    """Trace every stage's joint graph, last stage first, so that a stage gives a tangent only to
    outputs whose gradient the next stage can produce. With `recompute_levels`, each joint's
    `alternatives` hold the same stage separated once per level, the backward recomputing the
    forward nodes the level's predicate accepts (see `recompute.py`). `reuse_blocks`: see
    `export_stage_joint`."""
    joints: list[StageJoint] = []
    grads_from_next: set[str] = set()
    blocks: dict = {}  # the block segments exported so far, for all stages (`stitched_joint`)
    for stage in reversed(partition.stages):
        last = stage.index == len(partition.stages) - 1
        joint, alternatives = export_stage_joint(
            stage, partition, grads_from_next, loss_name if last else None, fake_mode, recompute_levels,
            blocks if reuse_blocks else None,
        )
        output_grads = tuple(v for v in stage.outputs if v in grads_from_next)
        alternatives = tuple(dataclasses.replace(a, output_grads=output_grads) for a in alternatives)
        joint = dataclasses.replace(joint, output_grads=output_grads, alternatives=alternatives)
        # gradients this stage provides to its predecessor: its own, and relayed ones
        grads_from_next = set(joint.input_grads) | {v for v in stage.relays if v in grads_from_next}
        joints.append(joint)
    return tuple(reversed(joints))


def export_stage_joint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], loss_name: str | None, fake_mode,
    recompute_levels: Sequence[Callable[[fx.Node], bool]] = (), blocks: dict | None = None,
) -> tuple[StageJoint, tuple[StageJoint, ...]]:
    """The stage's joint, separated as it is and once per recompute level. `blocks` (a dict, one
    for all stages; None: the stage traced whole): the joint graph assembled from its blocks'
    joints, each distinct block traced once and kept in `blocks` for the next stages
    (`block_joint.stitched_joint`: the same graph op for op), where that is evidently exact."""
    parallel = tensor_parallel.has_calls(stage.module)
    joint = None
    if blocks is not None and not parallel:
        joint = stitched_joint(stage, partition, grads_from_next, loss_name, fake_mode, blocks)
    partial: set[str] = set()
    if joint is None:
        module = tensor_parallel.lowered(_prepare_outputs(stage, grads_from_next, loss_name))
        try:
            with tensor_parallel.recording_partial_grads() as partial:
                joint = ti.export_joint(module, _example_inputs(stage, partition, fake_mode))
        except Exception as error:  # noqa: BLE001 - re-raised, naming the stage and the op's module
            raise _backward_error(stage, error) from error
    _refuse_mutated_state(joint, stage)
    separated = _separate_forward(joint, stage, loss_name)  # reads the joint only (its constants inlined once)
    alternatives = tuple(_separate_forward(joint, stage, loss_name, level) for level in recompute_levels)
    if partial:
        separated = dataclasses.replace(separated, partial_grads=tuple(sorted(partial)))
        alternatives = tuple(dataclasses.replace(a, partial_grads=separated.partial_grads) for a in alternatives)
    return separated, alternatives


def _backward_error(stage: Stage, error: Exception) -> Exception:
    """`error` from deriving a stage's backward, naming the stage, and the module and source line
    of the op it names (e.g. a custom op without an autograd formula)."""
    text = str(error)
    culprit = next((n for n in stage.module.graph.nodes if n.op == "call_function" and _names_op(text, n.target)), None)
    where = "" if culprit is None else f" at {node_location(culprit)}"
    message = (
        f"zbcompile could not derive the backward of stage {stage.index}{where}: {type(error).__name__}: "
        f"{first_line(error)}"
    )
    return same_kind(error, message)


def _names_op(text: str, target: object) -> bool:
    """Whether `text` names the operator `target` (`ns::op` or `ns.op.overload`)."""
    names = {str(target)}
    if hasattr(target, "name"):
        names.add(target.name())
    return any(re.search(rf"(?<![\w.:]){re.escape(name)}(?!\w)", text) for name in names)


def _example_inputs(stage: Stage, partition: StagePartition, fake_mode) -> tuple[torch.Tensor, ...]:
    """Tensors shaped and strided like the stage's inputs; boundary values that carry a gradient
    require one."""
    examples = []
    for name, node in zip(stage.graph_inputs, stage.module.graph.find_nodes(op="placeholder")):
        value = node.meta["val"]
        if not isinstance(value, torch.Tensor):  # a symbolic size (`shape_symbols.py`)
            examples.append(value)
            continue
        info = partition.values.get(name)
        example = ti.fake_strided(fake_mode, value.shape, value.stride(), value.dtype, value.device)
        examples.append(example.requires_grad_(info is not None and info.differentiable))
    return tuple(examples)


def _prepare_outputs(stage: Stage, grads_from_next: set[str], loss_name: str | None) -> fx.GraphModule:
    """A copy of the stage module whose outputs that get no gradient downstream (buffer updates
    never do) are detached, and whose outputs that are views of a stage input or parameter are
    copied: AOTAutograd regenerates such an output outside its graph and gives it no tangent,
    which would cut the gradient's path through the stage (a stage that only reshapes, say)."""
    if loss_name is not None and not stage.buffer_updates:
        return stage.module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    _fx.copy_nodes(graph, [n for n in stage.module.graph.nodes if n.op != "output"], env)
    roots = _fx.storage_roots(stage.module.graph)
    outputs = []
    returned = stage.module.graph.output_node().args[0]
    for i, node in enumerate(returned):
        value = env[node]
        if loss_name is not None and i == 0:
            pass  # the loss, as it is
        elif i >= len(stage.graph_outputs) or stage.graph_outputs[i] not in grads_from_next:
            value = graph.call_function(torch.ops.aten.detach.default, (value,))
        elif roots[node].op in ("placeholder", "get_attr"):
            value = graph.call_function(torch.ops.aten.clone.default, (value,))
            value.meta = dict(node.meta)
        outputs.append(value)
    graph.output(tuple(outputs))
    return _fx.finish(graph, stage.module, name=type(stage.module).__name__)


def _refuse_mutated_state(joint: fx.GraphModule, stage: Stage) -> None:
    for desc in joint.graph.output_node().meta["desc"]:
        mutated = getattr(desc, "mutated_input", None)
        if mutated is not None:
            raise ValueError(
                f"stage {stage.index} mutates {getattr(mutated, 'target', mutated)} in place during the "
                "forward in a way the trace did not turn into a buffer update; write the new value into a "
                "buffer of the module (`self.buf.copy_(new)`) or return it instead."
            )


def _placeholder_name(desc: object, stage: Stage) -> str:
    if isinstance(desc, ti.ParamAOTInput):
        return param_name(stage.state_fqns.get(desc.target, desc.target))
    if isinstance(desc, ti.BufferAOTInput):
        return buffer_name(stage.state_fqns.get(desc.target, desc.target))
    if isinstance(desc, ti.PlainAOTInput):
        return input_name(stage.graph_inputs[desc.idx])
    if isinstance(desc, ti.TangentAOTInput) and isinstance(desc.output, ti.PlainAOTOutput):
        return tangent_name(stage.graph_outputs[desc.output.idx])
    raise NotImplementedError(f"stage {stage.index}: unsupported joint graph input {desc}")


def _output_name(desc: object, stage: Stage, loss_name: str | None) -> str | None:
    if isinstance(desc, ti.PlainAOTOutput):
        if desc.idx >= len(stage.graph_outputs):
            return update_name(stage.buffer_updates[desc.idx - len(stage.graph_outputs)])
        return output_name(loss_name or stage.graph_outputs[desc.idx])
    if isinstance(desc, ti.GradAOTOutput):
        of = desc.grad_of
        if isinstance(of, ti.ParamAOTInput):
            return param_grad_name(stage.state_fqns.get(of.target, of.target))
        if isinstance(of, ti.PlainAOTInput):
            return grad_name(stage.graph_inputs[of.idx])
        return None  # a buffer's gradient: buffers are not trained
    raise NotImplementedError(f"stage {stage.index}: unsupported joint graph output {desc}")


def _inline_constants(joint: fx.GraphModule, stage: Stage) -> None:
    """AOTAutograd lifts the stage module's tensor constants (`torch.tensor(...)` or a scalar
    fill in the model's forward, see `partition`) into buffer inputs; the runtime's state holds
    only the model's own buffers, so each becomes a `get_attr` of `joint` again, holding the
    real constant, which every graph extracted from `joint` then carries (under a name of its own:
    the joint's trace may have made constants of the same names, as DTensor's code does)."""
    for node in list(joint.graph.find_nodes(op="placeholder")):
        desc = node.meta["desc"]
        if isinstance(desc, ti.BufferAOTInput) and desc.target not in stage.state_fqns:
            name = desc.target if not hasattr(joint, desc.target) else _fresh(f"{desc.target}_stage", set(dir(joint)))
            joint.register_buffer(name, getattr(stage.module, desc.target))
            with joint.graph.inserting_before(node):
                constant = joint.graph.get_attr(name)
            constant.meta = {k: v for k, v in node.meta.items() if k != "desc"}
            node.replace_all_uses_with(constant)
            joint.graph.erase_node(node)


def _separate_forward(
    joint: fx.GraphModule, stage: Stage, loss_name: str | None, recompute_also: Callable[[fx.Node], bool] | None = None
) -> StageJoint:
    """F and the backward of `joint`; the backward recomputes the checkpointed forward nodes and
    those `recompute_also` accepts, instead of reading them saved."""
    _inline_constants(joint, stage)
    graph = joint.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    names = {n: _placeholder_name(n.meta["desc"], stage) for n in placeholders}
    if loss_name is not None:  # the loss's tangent is `tangent:loss`, whatever its output's name
        names = {n: (tangent_name(loss_name) if v.startswith(TANGENT) else v) for n, v in names.items()}
    output_node = graph.output_node()
    outputs = []
    for node, desc in zip(output_node.args[0], output_node.meta["desc"]):
        name = _output_name(desc, stage, loss_name) if desc is not None else None
        if node is not None and name is not None:
            outputs.append((node, name))
    forward_outputs = [(n, v) for n, v in outputs if v.startswith((OUTPUT, UPDATE))]
    grad_outputs = [(n, v) for n, v in outputs if v.startswith(GRAD)]

    state = {n for n in placeholders if is_state(names[n])}
    tangents = {n for n in placeholders if names[n].startswith(TANGENT)}
    recompute = _fx.state_only_nodes(graph, state)
    forward_nodes = _fx.ancestors([n for n, _ in forward_outputs]) - set(placeholders)
    # every element of a forward op's tuple result is a forward value (a saved mean or rstd)
    forward_nodes |= {u for n in forward_nodes if _fx.is_multi_output(n) for u in n.users}
    # a gradient may be a backward input itself (a stage input added to a constant passes its
    # tangent on unchanged) or a recomputed state value: the backward reads or recomputes it
    returned = {n for n, _ in grad_outputs}
    backward_nodes = _fx.ancestors(returned, stop=forward_nodes) - set(placeholders) - forward_nodes
    # forward values of checkpoint regions: computed again by the backward, not saved
    recomputed = recompute_closure(backward_nodes, checkpointed_nodes(forward_nodes, recompute_also))
    backward_nodes = _fx.with_state_ancestors(backward_nodes | recomputed | (returned & recompute), recompute)
    forward_values = forward_nodes | {n for n in placeholders if names[n].startswith(INPUT)}
    kept = forward_values - recompute - recomputed
    saved = [n for n in graph.nodes if n in kept and (n in returned or any(u in backward_nodes for u in n.users))]
    for node in saved:
        names.setdefault(node, saved_name(node.name))
    roots = _fx.storage_roots(graph)
    storage = {names[n]: (roots[n].name, _fx.node_bytes(roots[n])) for n in [*saved, *tangents]}
    storage.update((v, (roots[n].name, _fx.node_bytes(roots[n]))) for n, v in forward_outputs if v.startswith(UPDATE))

    forward = extract_program(
        graph, body=forward_nodes, inputs=[n for n in placeholders if not names[n].startswith(TANGENT)],
        outputs=[*forward_outputs, *[(n, names[n]) for n in saved if n.op != "placeholder"]], names=names,
        class_name=f"Stage{stage.index}Forward",
    )
    backward_reads = state | tangents | set(saved)
    backward_inputs = [
        n for n in graph.nodes if n in backward_reads and (n in returned or any(u in backward_nodes for u in n.users))
    ]
    backward = extract_program(
        graph, body=backward_nodes, inputs=backward_inputs, outputs=grad_outputs,
        names={**names, **_updated_buffers(names, stage)}, class_name=f"Stage{stage.index}Backward",
    )
    recompute_when_needed(backward.graph, (n.name for n in recomputed))
    return StageJoint(
        stage=stage.index,
        forward=forward,
        backward=backward,
        tangents=tuple(fqn_of(names[n]) for n in placeholders if n in tangents),
        input_grads=tuple(fqn_of(v) for _, v in grad_outputs if not is_param_grad(v)),
        param_grads=tuple(fqn_of(v) for _, v in grad_outputs if is_param_grad(v)),
        storage=storage,
        recomputed=tuple(n.name for n in graph.nodes if n in recomputed),
    )


def _updated_buffers(names: dict[fx.Node, str], stage: Stage) -> dict[fx.Node, str]:
    """The placeholders of the buffers the stage updates, named `update:<fqn>` for the backward:
    what eager autograd saved of such a buffer (BatchNorm's running statistics) is the buffer
    itself, which the backward of an eager run microbatch by microbatch reads with this
    microbatch's update applied; the runtime's buffer may hold later microbatches' updates by then."""
    updated = {buffer_name(fqn): update_name(fqn) for fqn in stage.buffer_updates}
    return {n: updated[name] for n, name in names.items() if name in updated}


def _safe(name: str) -> str:
    """A readable Python identifier for an environment name (`param:blocks.0.fc.weight` ->
    `blocks_0_fc_weight`)."""
    body = fqn_of(name) if name.startswith((*STATE, INPUT)) else name
    identifier = re.sub(r"\W", "_", body)
    return f"_{identifier}" if identifier[0].isdigit() else identifier


def _fresh(candidate: str, taken: set[str]) -> str:
    """`candidate`, or the first of `<candidate>_input`, `<candidate>_input2`, ... not in `taken`."""
    name, number = candidate, 1
    while name in taken:
        name = f"{candidate}_input{number if number > 1 else ''}"
        number += 1
    return name


def extract_program(
    graph: fx.Graph, body: set[fx.Node], inputs: list[fx.Node], outputs: list[tuple[fx.Node, str]],
    names: dict[fx.Node, str], class_name: str,
) -> Program:
    """A Program computing `outputs` (node, environment name) from `inputs` by running the
    `body` nodes (in graph order). Inputs are named by `names`; the body's nodes keep their
    names (a placeholder never takes one), so that later passes can find a node of `graph`
    (`StageJoint.recomputed`) in the program by its name."""
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    given = set(inputs)
    copied = [n for n in graph.nodes if n in body and n not in given]
    taken = {n.name for n in copied}
    for node in inputs:
        env[node] = new_graph.placeholder(_fresh(_safe(names[node]), taken))
        env[node].meta = dict(node.meta)
        taken.add(env[node].name)
    _fx.copy_nodes(new_graph, copied, env)
    renamed = [n.name for n in copied if env[n].name != n.name]
    if renamed:
        raise RuntimeError(f"{class_name}: extracting the program renamed nodes {renamed[:4]}")
    new_graph.output(tuple(env[n] for n, _ in outputs))
    module = _fx.finish(new_graph, graph.owning_module, name=class_name)  # holds the tensor constants
    return Program(module, Signature(tuple(names[n] for n in inputs), tuple(name for _, name in outputs)))
