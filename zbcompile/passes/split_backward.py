"""Pass 4: split a stage's backward into B (input gradients) and W (weight gradients).

B computes the gradients of the stage inputs, which the previous stage waits for, and the
`stash:` values W will need; W computes the parameter gradients from the stash, the saved
activations and the tangents. B is the backward restricted to the ancestors of the input
gradients; W is what the parameter gradients need on top of it. Fused backward ops that return
input and weight gradients at once (`native_layer_norm_backward`, `convolution_backward`,
`native_group_norm_backward`: any op with an `output_mask` argument) are cloned: B's copy asks
only for what B needs, W's copy for the rest. Parameter views are recomputed in each graph.
On the first stage no input needs a gradient, so B is empty and W holds the whole backward.

Example (one linear layer y = x @ w.T + b, gradient g of y):

    B: (param:w, tangent:y) -> (grad:x = g @ w,)          stash: none (W reads tangent:y directly)
    W: (in:x, tangent:y)    -> (grad:param:w = g.T @ x, grad:param:b = g.sum(0))
"""

from __future__ import annotations

import copy
import itertools
import operator
from dataclasses import dataclass

import networkx as nx
from torch import fx

from zbcompile.passes import _fx, cost
from zbcompile.passes.joint import Program, StageJoint, extract_program


# Weight-gradient work is deferred to W only when it is worth the memory W must hold for it
# until then: at least this many FLOP-equivalents (`cost.node_cost`) per byte kept alive.
# Matmul and convolution weight gradients clear it by orders of magnitude; normalisation-layer
# weight gradients, whose deferral keeps the layer's input and output-gradient alive for a few
# elementwise operations, do not, so B computes them (as the paper's implementation does).
MIN_DEFERRAL_INTENSITY = 1.0


@dataclass(frozen=True)
class SplitBackward:
    """B and W of one stage. `stash` names what B computes for W; `weight_reads` every value W
    reads besides parameters (stash, saved activations, inputs, tangents); `freed_after_input`
    the saved values only B needed, dropped once B has run; `input_param_grads` the parameters
    whose gradients B computes itself (cheap ones, see MIN_DEFERRAL_INTENSITY)."""

    stage: int
    input_backward: Program
    weight_backward: Program
    stash: tuple[str, ...]
    weight_reads: tuple[str, ...]
    freed_after_input: tuple[str, ...]
    input_param_grads: tuple[str, ...] = ()


def split_backward(joint: StageJoint, min_deferral_intensity: float = MIN_DEFERRAL_INTENSITY) -> SplitBackward:
    """Split `joint`'s backward. With `min_deferral_intensity=0` every parameter gradient goes
    to W; by default those too cheap to be worth their memory stay in B (stages with input
    gradients only: on the first stage B stays empty)."""
    in_input = set()
    if min_deferral_intensity > 0:
        trial = _split(joint, frozenset())
        if trial.input_backward.signature.outputs:
            in_input = _cheap_weight_grads(trial, min_deferral_intensity)
    return _split(joint, frozenset(in_input))


def _split(joint: StageJoint, in_input: frozenset[str]) -> SplitBackward:
    """The split with the gradients named in `in_input` (`grad:param:<fqn>`) computed by B."""
    backward = joint.backward
    graph = copy.deepcopy(backward.graph).graph  # the rewrite below must not touch the input
    placeholders = list(graph.find_nodes(op="placeholder"))
    names = dict(zip(placeholders, backward.signature.inputs))
    for_input = [not v.startswith("grad:param:") or v in in_input for v in backward.signature.outputs]
    returned = graph.output_node().args[0]
    _split_fused_ops(graph, needed_by_input=_fx.ancestors([n for n, i in zip(returned, for_input) if i]))
    outputs = list(zip(graph.output_node().args[0], backward.signature.outputs))
    input_grads = [(n, v) for (n, v), i in zip(outputs, for_input) if i]
    param_grads = [(n, v) for (n, v), i in zip(outputs, for_input) if not i]
    state = {n for n in placeholders if names[n].startswith(("param:", "buffer:"))}
    recompute = _fx.state_only_nodes(graph, state)
    input_body = _fx.ancestors([n for n, _ in input_grads]) - set(placeholders)
    weight_body = _fx.ancestors([n for n, _ in param_grads], stop=input_body) - set(placeholders) - input_body
    weight_body = _fx.with_state_ancestors(weight_body, recompute)
    input_body -= weight_body & recompute  # each graph recomputes its own parameter views

    weight_outputs = {n for n, _ in param_grads}
    stash = [
        n
        for n in graph.nodes
        if n in input_body - recompute and (any(u in weight_body for u in n.users) or n in weight_outputs)
    ]
    for node in stash:
        names[node] = f"stash:{node.name}"

    def reads(body: set[fx.Node], returned: set[fx.Node]) -> list[fx.Node]:
        return [
            n
            for n in graph.nodes
            if n not in body and n.op != "output" and (n in returned or any(u in body for u in n.users))
        ]

    input_program = extract_program(
        graph,
        body=input_body,
        inputs=reads(input_body, {n for n, _ in input_grads}),
        outputs=[*input_grads, *[(n, names[n]) for n in stash]],
        names=names,
        class_name=f"Stage{joint.stage}InputBackward",
    )
    weight_inputs = reads(weight_body, weight_outputs)
    weight_program = extract_program(
        graph,
        body=weight_body,
        inputs=weight_inputs,
        outputs=param_grads,
        names=names,
        class_name=f"Stage{joint.stage}WeightBackward",
    )
    weight_reads = tuple(names[n] for n in weight_inputs if n not in state)
    saved = [v for v in backward.signature.inputs if v.startswith(("saved:", "in:", "tangent:"))]
    return SplitBackward(
        stage=joint.stage,
        input_backward=input_program,
        weight_backward=weight_program,
        stash=tuple(names[n] for n in stash),
        weight_reads=weight_reads,
        freed_after_input=tuple(v for v in saved if v not in weight_reads),
        input_param_grads=tuple(sorted(v.removeprefix("grad:param:") for v in in_input)),
    )


def _cheap_weight_grads(split: SplitBackward, min_intensity: float) -> set[str]:
    """Gradients (`grad:param:<fqn>`) whose W work costs less than `min_intensity` per byte of
    memory that only it keeps alive until W. Gradients computed by shared W nodes (a norm's
    weight and bias) are decided together."""
    graph = split.weight_backward.graph.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    read_name = dict(zip(placeholders, split.weight_backward.signature.inputs))
    roots = _fx.storage_roots(graph)
    outputs = list(zip(graph.output_node().args[0], split.weight_backward.signature.outputs))
    state = {p for p in placeholders if read_name[p].startswith(("param:", "buffer:"))}
    parameter_views = _fx.state_only_nodes(graph, state)
    body = {n: _fx.ancestors([n]) - set(placeholders) - parameter_views for n, _ in outputs}
    groups = nx.Graph()
    groups.add_nodes_from(name for _, name in outputs)
    for (a, name_a), (b, name_b) in itertools.combinations(outputs, 2):
        if body[a] & body[b]:
            groups.add_edge(name_a, name_b)
    node_of = {name: n for n, name in outputs}
    cheap: set[str] = set()
    for group in nx.connected_components(groups):
        nodes = set().union(*(body[node_of[g]] for g in group))
        others = set().union(*(body[n] for n, name in outputs if name not in group)) if len(group) < len(outputs) else set()
        held = _read_storage(nodes, placeholders, roots, read_name) - _read_storage(others, placeholders, roots, read_name)
        held_bytes = sum(size for _, size in held)
        work = sum(cost.node_cost(n) for n in nodes)
        if held_bytes and work < min_intensity * held_bytes:
            cheap |= set(group)
    return cheap


def _read_storage(nodes: set[fx.Node], placeholders, roots, read_name) -> set[tuple[str, int]]:
    """(storage, bytes) of the non-parameter W inputs `nodes` read."""
    result = set()
    for placeholder in placeholders:
        name = read_name[placeholder]
        if name.startswith(("param:", "buffer:")):
            continue
        if any(u in nodes for u in placeholder.users):
            result.add((name, _fx.node_bytes(roots[placeholder])))
    return result


def _split_fused_ops(graph: fx.Graph, needed_by_input: set[fx.Node]) -> None:
    """Clone each op with an `output_mask` whose results feed both B and W into a B copy that
    computes only what B needs and a W copy that computes the rest."""
    for node in list(graph.nodes):
        mask_index = _output_mask_index(node)
        if mask_index is None or node not in needed_by_input:
            continue
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        for_input = {i for i, g in getitems.items() if g in needed_by_input}
        for_weight = {i for i, g in getitems.items() if g not in needed_by_input and g.users}
        if not for_weight:
            continue
        mask = node.args[mask_index]
        with graph.inserting_after(node):
            weight_node = graph.call_function(node.target, _with_mask(node.args, mask_index, mask, for_weight), node.kwargs)
            weight_node.meta = {**node.meta, "val": _masked_value(node.meta.get("val"), for_weight)}
        node.args = _with_mask(node.args, mask_index, mask, for_input)
        node.meta["val"] = _masked_value(node.meta.get("val"), for_input)
        for i in for_weight:
            with graph.inserting_after(weight_node):
                replacement = graph.call_function(operator.getitem, (weight_node, i))
                replacement.meta = dict(getitems[i].meta)
            getitems[i].replace_all_uses_with(replacement)
            graph.erase_node(getitems[i])


def _masked_value(value, keep: set[int]):
    """The op's result metadata with the outputs it no longer computes set to None."""
    if not isinstance(value, (tuple, list)):
        return value
    return tuple(v if i in keep else None for i, v in enumerate(value))


def _output_mask_index(node: fx.Node) -> int | None:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name == "output_mask":
            return i if i < len(node.args) else None
    return None


def _with_mask(args: tuple, index: int, mask: list[bool], keep: set[int]) -> tuple:
    return (*args[:index], [bool(m) and i in keep for i, m in enumerate(mask)], *args[index + 1 :])
