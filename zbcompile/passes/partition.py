"""Pass 2: cut the traced forward graph into contiguous pipeline stages.

`partition_stages(traced, stages, split_points=None)` orders the *anchored* nodes (those that depend
on a model input or the target) as traced and cuts that sequence into `stages` runs. Nodes that
depend only on parameters, buffers and constants (weight transposes, `arange`, masks) are not
placed: every stage that needs one recomputes it, so a stage only ever receives activations. Without
split points the cut minimises the costliest stage (FLOPs plus bytes, `graph_cost.node_cost`) and,
among cuts within `balance_tolerance` of that optimum, the bytes that cross stage boundaries. Where
a stage may begin and where the cuts go is `cut_positions.py`'s job; this module builds the stage
graphs around the cuts. A value needed by a stage further down is relayed through the stages in
between, so all communication is between neighbours.

Example: a 2-layer MLP cut in two (`fc1 -> relu -> fc2 -> mse`):

    stage 0: inputs (input_0)       params fc1.*   outputs (relu)
    stage 1: inputs (relu, target_0) params fc2.*   outputs (loss)

Each `Stage.module` is a GraphModule whose placeholders are `graph_inputs` (boundary values it
reads, then targets) and whose parameters and buffers are `get_attr`s of the traced fake
parameters and buffers under their FQNs (`_state_module`), so AOTAutograd sees them as parameters.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import torch
from torch import fx, nn

from zbcompile.passes import _fx
from zbcompile.passes.cut_positions import (
    BufferUpdate,
    allowed_cuts,
    anchored_nodes,
    balanced_cuts,
    boundary_values,
    buffer_updates,
    cuts_at_split_points,
    cuts_keeping_params,
    live_bytes_at,
    role,
)
from zbcompile.passes.graph_cost import node_cost
from zbcompile.passes.shape_symbols import ROLE_SIZE, numel_hint
from zbcompile.passes.trace import ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, ROLE_TARGET, TracedModel


@dataclass(frozen=True)
class ValueInfo:
    """Shape, strides and dtype of a value that crosses a stage boundary (the receiving stage's
    graph was traced with these strides: a transposed attention output stays transposed);
    `differentiable` when a gradient may flow back through it (floating point or complex,
    computed from parameters)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    differentiable: bool

    @property
    def nbytes(self) -> int:
        return numel_hint(self.shape) * torch.empty((), dtype=self.dtype).element_size()  # symbolic: at the example


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of the forward graph.

    inputs: boundary values arriving from the previous stage (stage 0: the model's tensor
        inputs), by global value name. outputs: boundary values sent to the next stage (the
        last stage: none; its graph returns the loss). relays: inputs forwarded unchanged into
        outputs. graph_inputs: the module's placeholders in order (inputs it reads, then target
        tensors, then the symbolic sizes it reads, `shape_symbols.py`); graph_outputs: what the
        module returns (values it computes for outputs, or the loss). state_fqns: the FQN of
        each parameter or buffer the module reads, by its attribute path in the module (the FQN
        itself unless it contains a Python keyword, see
        `_state_attribute_paths`). buffer_updates: the buffers whose new value the stage
        computes (every update of a buffer runs on the one stage that reads the buffer); the
        module returns these values after `graph_outputs`.
    """

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    relays: tuple[str, ...]
    graph_inputs: tuple[str, ...]
    graph_outputs: tuple[str, ...]
    param_fqns: tuple[str, ...]
    buffer_fqns: tuple[str, ...]
    cost: float
    state_fqns: dict[str, str] = field(default_factory=dict)
    buffer_updates: tuple[str, ...] = ()


@dataclass(frozen=True)
class StagePartition:
    """Stages in pipeline order, the stage of every anchored forward node (by node name), the
    bytes crossing each boundary, the cut positions (where stages 1.. begin among the anchored
    nodes), shapes of boundary values, and parameters used by more than one stage (tied weights)
    with the stages using them (the first one owns the parameter)."""

    stages: tuple[Stage, ...]
    stage_of_node: dict[str, int]
    boundary_bytes: tuple[int, ...]
    cuts: tuple[int, ...]
    values: dict[str, ValueInfo]
    shared_params: dict[str, tuple[int, ...]]


def partition_stages(
    traced: TracedModel, stages: int, split_points: Sequence[str] | None = None, balance_tolerance: float = 0.05,
    cuts: Sequence[int] | None = None, stage_params: Sequence[frozenset[str]] | None = None,
) -> StagePartition:
    """`cuts`, when given, are the positions (in the anchored-node order) where stages 1..S-1
    begin, as in `StagePartition.cuts` of an earlier partition of the same model; with
    `stage_params` (each stage's parameters in that partition) they may come from a trace whose
    nodes differ, and the cut where each stage reads the same parameters is taken."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    graph = traced.graph_module.graph
    anchors = anchored_nodes(graph)
    updates = buffer_updates(traced, anchors)
    allowed = allowed_cuts(anchors, [u.span for u in updates])
    live_bytes = live_bytes_at(anchors, graph)
    if stage_params is not None:
        cuts = cuts_keeping_params(anchors, allowed, live_bytes, stage_params, cuts)
    elif cuts is not None:
        cuts = list(cuts)
        if len(cuts) != stages - 1 or not set(cuts) <= set(allowed) or cuts != sorted(cuts):
            raise ValueError(f"cuts {cuts} are not {stages - 1} increasing allowed positions for this graph")
    elif split_points is not None:
        cuts = cuts_at_split_points(anchors, allowed, list(split_points), stages, updates)
    else:
        if stages - 1 > len(allowed):
            raise ValueError(
                f"stages={stages} but the model can be cut at only {len(allowed)} place(s), so it has "
                f"at most {len(allowed) + 1} stage(s); ask for fewer stages."
            )
        costs = [node_cost(n) for n in anchors]
        cuts = balanced_cuts(costs, live_bytes, allowed, stages, balance_tolerance)
    bounds = [0, *cuts, len(anchors)]
    stage_of = {n: k for k in range(stages) for n in anchors[bounds[k] : bounds[k + 1]]}
    return _build_stages(traced, anchors, stage_of, bounds, live_bytes, updates)


# --- building the stage graphs -----------------------------------------------------------------
def _value_name(node: fx.Node) -> str:
    return node.meta["zb_name"] if node.op == "placeholder" else node.name


def _requires_grad(graph: fx.Graph) -> set[fx.Node]:
    """Values computed from parameters through differentiable ops (`_fx.requires_grad_closure`)."""
    return _fx.requires_grad_closure(graph, {n for n in graph.nodes if role(n) == ROLE_PARAM})


def _build_stages(
    traced: TracedModel, anchors: list[fx.Node], stage_of: dict[fx.Node, int], bounds: list[int], live_bytes: list[int],
    updates: Sequence[BufferUpdate] = (),
) -> StagePartition:
    graph = traced.graph_module.graph
    paths = _state_attribute_paths([*traced.param_fqns, *traced.buffer_fqns])
    root = _state_module(traced, paths)
    stages_count = len(bounds) - 1
    differentiable = _requires_grad(graph)
    results = list(graph.output_node().args[0][: traced.results])  # the loss, or the model's outputs

    def producer_stage(node: fx.Node) -> int:
        return 0 if role(node) == ROLE_INPUT else stage_of[node]

    # boundary: stage k receives every value produced before it and read by a later stage
    crossing: list[list[fx.Node]] = [[] for _ in range(stages_count)]
    for node, _, _ in boundary_values(anchors, graph, results):
        readers = [stage_of[u] for u in node.users if u in stage_of] + ([stages_count - 1] if node in results else [])
        for k in range(producer_stage(node) + 1, max(readers) + 1):
            crossing[k].append(node)

    dependencies = _dependency_graph(graph)
    anchored = set(anchors) | {n for n in graph.nodes if role(n) in (ROLE_INPUT, ROLE_TARGET)}
    stages = []
    shared: dict[str, list[int]] = {}
    for k in range(stages_count):
        own = anchors[bounds[k] : bounds[k + 1]]
        own_set = set(own)
        mine = [u for u in updates if bounds[k] <= u.position < bounds[k + 1] or (k == 0 and not anchors)]
        computed_here = [u.value for u in mine if u.value not in own_set]  # an update not anchored
        if k == stages_count - 1:  # a result that reads no input (a parameter's value, say) is computed where returned
            computed_here += [n for n in results if n.op == "call_function" and n not in stage_of]
        free = _free_ancestors([*own, *computed_here], dependencies, anchored) | set(computed_here)
        reads = {a for n in own for a in n.all_input_nodes} - own_set - free
        if k == stages_count - 1:  # results computed upstream arrive to be returned
            reads |= {n for n in results if n not in own_set and n not in free}
        read_inputs = [n for n in graph.nodes if n in reads]  # graph order
        stage_inputs = list(crossing[k]) if k > 0 else [n for n in graph.nodes if role(n) == ROLE_INPUT]
        boundary_reads = [n for n in read_inputs if role(n) != ROLE_TARGET]
        targets = [n for n in read_inputs if role(n) == ROLE_TARGET]
        missing = [n for n in boundary_reads if n not in stage_inputs]
        assert not missing, f"stage {k} reads {missing} that never reach it"
        next_inputs = crossing[k + 1] if k + 1 < stages_count else []
        produced_out = [n for n in next_inputs if n in own_set]
        relays = [n for n in next_inputs if n not in own_set]
        graph_outputs = produced_out if k + 1 < stages_count else results

        params = [n for n in graph.nodes if n in free and role(n) == ROLE_PARAM]
        buffers = [n for n in graph.nodes if n in free and role(n) == ROLE_BUFFER]
        elsewhere = {b.meta["zb_name"] for b in buffers} & ({u.fqn for u in updates} - {u.fqn for u in mine})
        assert not elsewhere, f"stage {k} reads buffers {sorted(elsewhere)} that another stage updates"
        constants = [n for n in graph.nodes if n in free and n.op == "get_attr"]
        sizes = [n for n in graph.nodes if n in free and role(n) == ROLE_SIZE]  # every stage reads its own
        for p in params:
            shared.setdefault(p.meta["zb_name"], []).append(k)

        new_graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in [*boundary_reads, *targets, *sizes]:
            env[node] = new_graph.placeholder(_value_name(node))
            env[node].meta = dict(node.meta)
        for node in [*params, *buffers]:
            env[node] = new_graph.get_attr(paths[node.meta["zb_name"]])
            env[node].meta = dict(node.meta)
        for node in constants:
            env[node] = new_graph.get_attr(node.target)
            env[node].meta = dict(node.meta)
        body = [n for n in graph.nodes if (n in free and n.op == "call_function") or n in own_set]
        _fx.copy_nodes(new_graph, body, env)
        new_graph.output(tuple(env[n] for n in [*graph_outputs, *(u.value for u in mine)]))
        module = _fx.finish(new_graph, root, name=f"Stage{k}", read_only=True)
        stages.append(
            Stage(
                index=k,
                module=module,
                inputs=tuple(_value_name(n) for n in stage_inputs),
                outputs=tuple(_value_name(n) for n in next_inputs),
                relays=tuple(_value_name(n) for n in relays),
                graph_inputs=tuple(_value_name(n) for n in [*boundary_reads, *targets, *sizes]),
                graph_outputs=tuple(_value_name(n) for n in graph_outputs),
                param_fqns=tuple(p.meta["zb_name"] for p in params),
                buffer_fqns=tuple(b.meta["zb_name"] for b in buffers),
                cost=sum(node_cost(n) for n in own),
                state_fqns={paths[n.meta["zb_name"]]: n.meta["zb_name"] for n in [*params, *buffers]},
                buffer_updates=tuple(u.fqn for u in mine),
            )
        )

    values = {}
    for node in {n for cross in crossing for n in cross}:
        value = node.meta["val"]
        carries_grad = node in differentiable and _fx.is_differentiable(value)
        values[_value_name(node)] = ValueInfo(tuple(value.shape), tuple(value.stride()), value.dtype, carries_grad)
    return StagePartition(
        stages=tuple(stages),
        stage_of_node={n.name: k for n, k in stage_of.items()},
        boundary_bytes=tuple(live_bytes[b] for b in bounds[1:-1]),
        cuts=tuple(bounds[1:-1]),
        values=values,
        shared_params={fqn: tuple(ks) for fqn, ks in shared.items() if len(ks) > 1},
    )


def _state_attribute_paths(fqns: Sequence[str]) -> dict[str, str]:
    """The attribute path of each FQN in the stage modules. FX writes a `get_attr` into Python
    source as `self.<path>`, which fails to compile where a component is a keyword
    (`nn.ModuleDict({"in": ...})` gives `layers.in.weight`): such a component gets a `_` appended
    (more if the name is taken)."""
    taken = set(fqns)
    paths = {}
    for fqn in fqns:
        parts = fqn.split(".")
        if not any(keyword.iskeyword(p) for p in parts):
            paths[fqn] = fqn
            continue
        suffix = "_"
        while (path := ".".join(p + suffix if keyword.iskeyword(p) else p for p in parts)) in taken:
            suffix += "_"
        taken.add(path)
        paths[fqn] = path
    return paths


def _state_module(traced: TracedModel, paths: dict[str, str]) -> nn.Module:
    """A module tree holding the traced fake parameters and buffers under their attribute paths
    (`_state_attribute_paths`: the FQNs, unless they contain a keyword): the stages' `get_attr`s
    resolve to these, never to the (possibly unmaterialised) model's tensors. The traced graph's
    tensor constants (`torch.tensor(...)` in the forward) are plain attributes holding the real
    tensors: they are part of the program."""
    root = nn.Module()
    for node in traced.graph_module.graph.find_nodes(op="get_attr"):
        setattr(root, node.target, getattr(traced.graph_module, node.target))
    for fqn in [*traced.param_fqns, *traced.buffer_fqns]:
        *path, leaf = paths[fqn].split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        value = traced.fake_state[fqn]
        if fqn in traced.param_fqns:
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)
    return root


def _dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    dependencies = nx.DiGraph()
    for node in graph.nodes:
        dependencies.add_node(node)
        for source in node.all_input_nodes:
            dependencies.add_edge(source, node)
    return dependencies


def _free_ancestors(own: list[fx.Node], dependencies: nx.DiGraph, anchored: set[fx.Node]) -> set[fx.Node]:
    """Parameters, buffers, tensor constants and input-independent nodes the stage's anchored
    nodes need."""
    free: set[fx.Node] = set()
    frontier = [a for n in own for a in n.all_input_nodes]
    while frontier:
        node = frontier.pop()
        if node in free:
            continue
        if role(node) in (ROLE_PARAM, ROLE_BUFFER, ROLE_SIZE) or node.op == "get_attr" or (
            node.op == "call_function" and node not in anchored
        ):
            free.add(node)
            frontier.extend(dependencies.predecessors(node))
    return free

