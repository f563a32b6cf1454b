"""Pass 4: split a stage's backward into I (input gradients) and W (weight gradients).

I computes the gradients of the stage inputs, which the previous stage waits for, and the
`stash:` values W will need; W computes the parameter gradients from the stash, the saved
activations and the tangents. I is the backward restricted to the ancestors of the input
gradients; W is what the parameter gradients need on top of it. Fused backward ops that return
input and weight gradients at once (`native_layer_norm_backward`, `convolution_backward`,
`native_group_norm_backward`: any op with an `output_mask` argument) are cloned: I's copy asks
only for what I needs, W's copy for the rest. Parameter views are recomputed in each graph.
On the first stage no input needs a gradient; there I computes the activations' gradients (those
that reach the parameters of more than one module, down to the first layers' outputs) and W the
weight gradients from them, as on every other stage, where W then holds fewer bytes until it runs
than the whole backward reads (`activation_chain`, `held_until_weight`); else I is empty.
`split_backward_program` is the graph-level core, for any backward Program named this way (the
`torch.compile` backend splits AOTAutograd's backward graphs with it); `split_backward` applies
it to a pipeline stage.

Example (one linear layer y = x @ w.T + b, gradient g of y):

    I: (param:w, tangent:y) -> (grad:x = g @ w,)          stash: none (W reads tangent:y directly)
    W: (in:x, tangent:y)    -> (grad:param:w = g.T @ x, grad:param:b = g.sum(0))
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from dataclasses import dataclass

import networkx as nx
from torch import fx

from zbcompile.passes import _fx, graph_cost
from zbcompile.passes.joint import StageJoint, extract_program
from zbcompile.passes.program import Program
from zbcompile.value_names import INPUT, SAVED, TANGENT, fqn_of, is_param_grad, is_stash, is_state, stash_name

# Weight-gradient work is deferred to W only when it is worth the memory W must hold for it
# until then: at least this many FLOP-equivalents (`graph_cost.node_cost`) per byte kept alive.
# Matmul and convolution weight gradients clear it by orders of magnitude; normalisation-layer
# weight gradients, whose deferral keeps the layer's input and output-gradient alive for a few
# elementwise operations, do not, so I computes them (as the paper's implementation does).
MIN_DEFERRAL_INTENSITY = 1.0


@dataclass(frozen=True)
class IWPrograms:
    """I and W of one backward Program (the graph-level result, for any caller: a pipeline stage
    or a `torch.compile` region). `stash` names what I computes for W; `weight_reads` every
    value W reads besides parameters and buffers (stash, saved activations, inputs, tangents);
    `input_param_grads` the parameters (`grad:param:<name>` without the prefix) whose gradients
    I computes itself (cheap ones, see MIN_DEFERRAL_INTENSITY)."""

    input_backward: Program
    weight_backward: Program
    stash: tuple[str, ...]
    weight_reads: tuple[str, ...]
    input_param_grads: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageIWPrograms(IWPrograms):
    """I and W of one stage, plus `freed_after_input`: the saved values only I needed, dropped
    once I has run."""

    stage: int = 0
    freed_after_input: tuple[str, ...] = ()


def split_backward(
    joint: StageJoint, min_deferral_intensity: float = MIN_DEFERRAL_INTENSITY, weight_recomputes: bool = False
) -> StageIWPrograms:
    """Split `joint`'s backward. With `min_deferral_intensity=0` every parameter gradient goes
    to W, with `math.inf` none does; by default those too cheap to be worth their memory stay in
    I. On a stage with no input gradient (the first), I computes the activations' gradients
    where that leaves W holding fewer bytes than the whole backward reads, else I stays empty.
    By default a recomputed forward value (`joint.recomputed`) that I and W both need is
    computed once, in I, and stashed for W; with `weight_recomputes` W computes it again from
    what F saved (less memory held until W, more time; a level of recompute="auto")."""
    again = frozenset(joint.recomputed) if weight_recomputes else frozenset()
    options = dict(class_prefix=f"Stage{joint.stage}", weight_recomputes=again)
    split = split_backward_program(joint.backward, min_deferral_intensity, **options)
    if all(is_param_grad(v) for v in joint.backward.signature.outputs):
        chained = split_backward_program(joint.backward, min_deferral_intensity, activation_chain=True, **options)
        if held_until_weight(joint, chained) < held_until_weight(joint, split):
            split = chained
    backward = joint.backward
    saved = [v for v in backward.signature.inputs if v.startswith((SAVED, INPUT, TANGENT))]
    return StageIWPrograms(
        **{f.name: getattr(split, f.name) for f in dataclasses.fields(IWPrograms)},
        stage=joint.stage,
        freed_after_input=tuple(v for v in saved if v not in split.weight_reads),
    )


def held_until_weight(joint: StageJoint, split: IWPrograms) -> int:
    """Bytes a stage keeps alive from I until W (M_W): the forward values W reads (directly, or
    through a stash entry that is a view of one; views of one tensor once) and the new tensors I
    computed for it."""
    graph = split.input_backward.graph.graph
    roots = _fx.storage_roots(graph)
    placeholder_names = dict(zip(graph.find_nodes(op="placeholder"), split.input_backward.signature.inputs))
    returned = graph.output_node().args[0]
    stash = [n for n, name in zip(returned, split.input_backward.signature.outputs) if is_stash(name)]
    held = {n for n in split.weight_reads if not is_stash(n)}
    held |= {placeholder_names[roots[n]] for n in stash if roots[n].op == "placeholder"}
    owned = {roots[n] for n in stash if roots[n].op != "placeholder"}
    return joint.held_bytes(held) + sum(_fx.node_bytes(n) for n in owned)


def split_backward_program(
    backward: Program, min_deferral_intensity: float = MIN_DEFERRAL_INTENSITY, class_prefix: str = "",
    weight_recomputes: frozenset[str] = frozenset(), activation_chain: bool = False,
) -> IWPrograms:
    """Split any backward Program whose inputs are named `param:`/`buffer:` (state, whose views
    each graph recomputes) or otherwise (values read from the environment), and whose outputs
    are `grad:param:<name>` (weight gradients, to W) or other names (input gradients, to I).
    Which cheap weight gradients stay in I is decided on the rewritten graph, before either
    program is extracted, so each program is extracted and compiled once. W computes the nodes
    named in `weight_recomputes` itself rather than reading them from I. With `activation_chain`,
    a backward with no input gradient gets an I all the same: the gradients of activations, the
    nodes whose results reach the parameters of two or more modules (`_activation_chain`)."""
    chain = activation_chain and all(is_param_grad(v) for v in backward.signature.outputs)
    partition = _partition(backward, frozenset(), weight_recomputes, chain)
    if min_deferral_intensity > 0 and partition.input_body:
        if math.isinf(min_deferral_intensity):  # nothing deferred
            in_input = {name for _, name in partition.param_grads}
        else:
            in_input = _cheap_weight_grads(partition, min_deferral_intensity)
        if in_input:
            partition = _partition(backward, frozenset(in_input), weight_recomputes, chain)
    return _extract(partition, class_prefix)


@dataclass
class _Partition:
    """The backward graph (a rewritten copy) with its nodes assigned to I and W."""

    graph: fx.Graph
    names: dict[fx.Node, str]
    input_grads: list[tuple[fx.Node, str]]
    param_grads: list[tuple[fx.Node, str]]
    state: set[fx.Node]
    recompute: set[fx.Node]
    input_body: set[fx.Node]
    weight_body: set[fx.Node]
    stash: list[fx.Node]
    weight_inputs: list[fx.Node]
    in_input: frozenset[str]


def _partition(
    backward: Program,
    in_input: frozenset[str],
    weight_recomputes: frozenset[str] = frozenset(),
    activation_chain: bool = False,
) -> _Partition:
    """Assign the nodes of a copy of `backward` to I and W, with the gradients named in
    `in_input` (`grad:param:<fqn>`) computed by I, and with `activation_chain` the gradients of
    activations too; fused ops are split by output mask."""
    graph = _copy(backward.graph)  # the rewrite below must not touch the input
    placeholders = list(graph.find_nodes(op="placeholder"))
    names = dict(zip(placeholders, backward.signature.inputs))
    for_input = [not is_param_grad(v) or v in in_input for v in backward.signature.outputs]
    returned = graph.output_node().args[0]
    chain = _activation_chain(graph, backward.signature.outputs) if activation_chain else set()
    _split_fused_ops(graph, needed_by_input=_fx.ancestors([*(n for n, i in zip(returned, for_input) if i), *chain]))
    outputs = list(zip(graph.output_node().args[0], backward.signature.outputs))
    input_grads = [(n, v) for (n, v), i in zip(outputs, for_input) if i]
    param_grads = [(n, v) for (n, v), i in zip(outputs, for_input) if not i]
    state = {n for n in placeholders if is_state(names[n])}
    # collectives (tensor parallelism's) run in I, in the same order on every rank of their group, never in W
    collectives = [n for n in graph.nodes if _fx.is_collective(n)]
    recompute = _fx.state_only_nodes(graph, state) - _fx.descendants(collectives)
    input_body = _fx.ancestors([*(n for n, _ in input_grads), *chain, *collectives]) - set(placeholders)
    weight_body = _fx.ancestors([n for n, _ in param_grads], stop=input_body) - set(placeholders) - input_body
    recompute |= {n for n in graph.nodes if n.op == "call_function" and n.name in weight_recomputes}
    weight_body = _fx.with_state_ancestors(weight_body, recompute)
    # W's elements of a tuple that I computes (a recomputed forward op's): taken in I, stashed
    from_input = {
        n
        for n in weight_body
        if n.target is operator.getitem and n.args[0] in input_body and n.args[0] not in weight_body
    }
    input_body, weight_body = input_body | from_input, weight_body - from_input

    weight_outputs = {n for n, _ in param_grads}
    computed = input_body - recompute
    stash = [
        n for n in graph.nodes if n in computed and (any(u in weight_body for u in n.users) or n in weight_outputs)
    ]
    for node in stash:
        names[node] = stash_name(node.name)
    return _Partition(
        graph, names, input_grads, param_grads, state, recompute, input_body, weight_body, stash,
        _reads(graph, weight_body, weight_outputs), in_input,
    )


def _activation_chain(graph: fx.Graph, outputs: tuple[str, ...]) -> set[fx.Node]:
    """The nodes of a backward graph whose results reach the gradients (`outputs`, all
    `grad:param:<fqn>`) of parameters of two or more modules: the gradients of activations and
    what computes them. A weight gradient's own work (a linear's `g.T @ x`, a norm's weight and
    bias) reaches one module's parameters and stays out. The set holds every ancestor of its
    members that is computed (a node reaches at least what its users reach)."""
    many = object()  # reaches two modules or more
    module_of = {node: fqn_of(v).rpartition(".")[0] for node, v in zip(graph.output_node().args[0], outputs)}
    reach: dict[fx.Node, object] = {}
    for node in reversed(graph.nodes):
        if node.op == "output":
            continue
        modules = {module_of[node]} if node in module_of else set()
        for user in node.users:
            theirs = reach.get(user)
            if theirs is many:
                modules = None
                break
            if theirs is not None:
                modules |= theirs
        reach[node] = many if modules is None or len(modules) > 1 else modules
    return {n for n, r in reach.items() if r is many and n.op == "call_function"}


def _copy(graph_module: fx.GraphModule) -> fx.Graph:
    """A copy of `graph_module`'s graph (nodes and names as they are, each node's meta a copy of
    its dict) owned by a module holding its tensor constants, to rewrite apart from the original."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return _fx.finish(graph, graph_module, name=type(graph_module).__name__, read_only=True).graph


def _reads(graph: fx.Graph, body: set[fx.Node], returned: set[fx.Node]) -> list[fx.Node]:
    """The nodes outside `body` that it reads or returns: the inputs of its extracted graph."""
    return [
        n
        for n in graph.nodes
        if n not in body and n.op != "output" and (n in returned or any(u in body for u in n.users))
    ]


def _extract(partition: _Partition, class_prefix: str) -> IWPrograms:
    p = partition
    input_program = extract_program(
        p.graph, body=p.input_body, inputs=_reads(p.graph, p.input_body, {n for n, _ in p.input_grads}),
        outputs=[*p.input_grads, *[(n, p.names[n]) for n in p.stash]], names=p.names,
        class_name=f"{class_prefix}InputBackward",
    )
    stray = [n.name for n in p.weight_body if _fx.is_collective(n)]
    if stray:
        raise RuntimeError(f"{class_prefix}: collectives {stray[:4]} would run in W; they belong in I")
    weight_program = extract_program(
        p.graph, body=p.weight_body, inputs=p.weight_inputs, outputs=p.param_grads, names=p.names,
        class_name=f"{class_prefix}WeightBackward",
    )
    return IWPrograms(
        input_backward=input_program,
        weight_backward=weight_program,
        stash=tuple(p.names[n] for n in p.stash),
        weight_reads=tuple(p.names[n] for n in p.weight_inputs if n not in p.state),
        input_param_grads=tuple(sorted(fqn_of(v) for v in p.in_input)),
    )


def _cheap_weight_grads(partition: _Partition, min_intensity: float) -> set[str]:
    """Gradients (`grad:param:<fqn>`) whose W work costs less than `min_intensity` per byte of
    memory that only it keeps alive until W. Gradients computed by shared W nodes (a norm's
    weight and bias) are decided together."""
    p = partition
    weight_inputs = set(p.weight_inputs)
    outputs = p.param_grads
    body = {n: _fx.ancestors([n], stop=weight_inputs) - weight_inputs - p.recompute for n, _ in outputs}
    groups = nx.Graph()
    groups.add_nodes_from(name for _, name in outputs)
    for (a, name_a), (b, name_b) in itertools.combinations(outputs, 2):
        if body[a] & body[b]:
            groups.add_edge(name_a, name_b)
    node_of = {name: n for n, name in outputs}
    held_inputs = [n for n in p.weight_inputs if n not in p.state]
    cheap: set[str] = set()
    for group in nx.connected_components(groups):
        nodes = set().union(*(body[node_of[g]] for g in group))
        others = (
            set().union(*(body[n] for n, name in outputs if name not in group)) if len(group) < len(outputs) else set()
        )
        held = _read_storage(nodes, held_inputs) - _read_storage(others, held_inputs)
        held_bytes = sum(size for _, size in held)
        work = sum(graph_cost.node_cost(n) for n in nodes)
        if held_bytes and work < min_intensity * held_bytes:
            cheap |= set(group)
    return cheap


def _read_storage(nodes: set[fx.Node], inputs: list[fx.Node]) -> set[tuple[fx.Node, int]]:
    """(input, bytes) of the W inputs among `inputs` that `nodes` read."""
    return {(n, _fx.node_bytes(n)) for n in inputs if any(u in nodes for u in n.users)}


def _split_fused_ops(graph: fx.Graph, needed_by_input: set[fx.Node]) -> None:
    """Clone each op with an `output_mask` whose results feed both I and W into an I copy that
    computes only what I needs and a W copy that computes the rest."""
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
            weight_node = graph.call_function(
                node.target, _with_mask(node.args, mask_index, mask, for_weight), node.kwargs
            )
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
