"""Pass 2: cut the traced forward graph into contiguous pipeline stages.

`partition_stages(traced, stages, split_points=None)` orders the *anchored* nodes (those that
depend on a model input or the target) as traced and cuts that sequence into `stages` runs.
Nodes that depend only on parameters, buffers and constants (weight transposes, `arange`,
masks) are not placed: every stage that needs one recomputes it, so a stage only ever receives
activations. Without split points the cut minimises the costliest stage (FLOPs plus bytes,
`graph_cost.node_cost`) and, among cuts within `balance_tolerance` of that optimum, the bytes that
cross stage boundaries. A value needed by a stage further down is relayed through the stages
in between, so all communication is between neighbours.

Example: a 2-layer MLP cut in two (`fc1 -> relu -> fc2 -> mse`):

    stage 0: inputs (input_0)       params fc1.*   outputs (relu)
    stage 1: inputs (relu, target_0) params fc2.*   outputs (loss)

Each `Stage.module` is a GraphModule whose placeholders are `graph_inputs` (boundary values it
reads, then targets) and whose parameters and buffers are `get_attr`s of the traced fake
parameters and buffers under their FQNs (`_state_module`), so AOTAutograd sees them as parameters.
"""

from __future__ import annotations

import bisect
import keyword
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import numpy as np
import torch
from torch import fx, nn

from zbcompile.passes import _fx
from zbcompile.passes.graph_cost import node_cost
from zbcompile.passes.trace import BUFFER, INPUT, PARAM, TARGET, TracedModel


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
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of the forward graph.

    inputs: boundary values arriving from the previous stage (stage 0: the model's tensor
        inputs), by global value name. outputs: boundary values sent to the next stage (the
        last stage: none; its graph returns the loss). relays: inputs forwarded unchanged into
        outputs. graph_inputs: the module's placeholders in order (inputs it reads, then target
        tensors); graph_outputs: what the module returns (values it computes for outputs, or
        the loss). state_fqns: the FQN of each parameter or buffer the module reads, by its
        attribute path in the module (the FQN itself unless it contains a Python keyword, see
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
    traced: TracedModel,
    stages: int,
    split_points: Sequence[str] | None = None,
    balance_tolerance: float = 0.05,
    cuts: Sequence[int] | None = None,
) -> StagePartition:
    """`cuts`, when given, are the positions (in the anchored-node order) where stages 1..S-1
    begin, as in `StagePartition.cuts` of an earlier partition of the same model."""
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    graph = traced.graph_module.graph
    anchors = _anchored_nodes(graph)
    updates = _buffer_updates(traced, anchors)
    allowed = _allowed_cuts(anchors, [u.span for u in updates])
    live_bytes = _live_bytes(anchors, graph)
    if cuts is not None:
        cuts = list(cuts)
        if len(cuts) != stages - 1 or not set(cuts) <= set(allowed) or cuts != sorted(cuts):
            raise ValueError(f"cuts {cuts} are not {stages - 1} increasing allowed positions for this graph")
    elif split_points is not None:
        cuts = _cuts_at_split_points(anchors, allowed, list(split_points), stages, updates)
    else:
        if stages - 1 > len(allowed):
            raise ValueError(
                f"stages={stages} but the model can be cut at only {len(allowed)} place(s), so it has "
                f"at most {len(allowed) + 1} stage(s); ask for fewer stages."
            )
        costs = [node_cost(n) for n in anchors]
        cuts = _balanced_cuts(costs, live_bytes, allowed, stages, balance_tolerance)
    bounds = [0, *cuts, len(anchors)]
    stage_of = {n: k for k in range(stages) for n in anchors[bounds[k] : bounds[k + 1]]}
    return _build_stages(traced, anchors, stage_of, bounds, live_bytes, updates)


# --- classifying nodes -------------------------------------------------------------------------


def _role(node: fx.Node) -> str | None:
    return node.meta.get("zb_role") if node.op == "placeholder" else None


def _value_name(node: fx.Node) -> str:
    return node.meta["zb_name"] if node.op == "placeholder" else node.name


def _anchored_nodes(graph: fx.Graph) -> list[fx.Node]:
    """call_function nodes that depend on an input or target, or draw random numbers; in trace
    order."""
    anchored: set[fx.Node] = set()
    order = []
    for node in graph.nodes:
        if _role(node) in (INPUT, TARGET):
            anchored.add(node)
        elif node.op == "call_function" and (
            any(a in anchored for a in node.all_input_nodes) or _fx.is_random(node)
        ):
            anchored.add(node)
            order.append(node)
    return order


def _target_dependent(graph: fx.Graph) -> set[fx.Node]:
    dependent = {n for n in graph.nodes if _role(n) == TARGET}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _allowed_cuts(anchors: list[fx.Node], together: Sequence[tuple[int, int]] = ()) -> list[int]:
    """Positions i (a stage starts at anchors[i]) that keep a multi-output op with its getitems,
    a value updated in place (some decompositions do, e.g. the RNN cells) with its producer, the
    update and every reader, each span of positions in `together` in one stage, and every node
    that reads the target in the last stage."""
    position = {n: i for i, n in enumerate(anchors)}
    blocked = [False] * (len(anchors) + 1)
    for first, last in together:
        for i in range(first + 1, last + 1):
            blocked[i] = True
    graph = anchors[0].graph if anchors else None
    roots = _fx.storage_roots(graph) if graph is not None else {}
    sharing: dict[fx.Node, list[fx.Node]] = {}  # storage root -> the nodes whose value lives in it
    for value, root in roots.items():
        sharing.setdefault(root, []).append(value)
    for node in anchors:
        if _fx.is_multi_output(node):
            last_getitem = max((position[u] for u in node.users if u in position), default=position[node])
            for i in range(position[node] + 1, last_getitem + 1):
                blocked[i] = True
        for _, written in _fx.written_arguments(node):
            root = roots.get(written) if isinstance(written, fx.Node) else None
            if root not in position:
                continue
            readers = [u for v in sharing[root] for u in v.users]
            last_read = max((position[u] for u in [node, *readers] if u in position), default=position[node])
            for i in range(position[root] + 1, last_read + 1):
                blocked[i] = True
    dependent = _target_dependent(graph) if graph is not None else set()
    first_target_use = min((position[n] for n in dependent if n in position), default=len(anchors))
    return [i for i in range(1, len(anchors)) if not blocked[i] and i <= first_target_use]


def _requires_grad(graph: fx.Graph) -> set[fx.Node]:
    """Floating-point and complex values computed from parameters through differentiable ops (an
    over-approximation: a stage that turns out not to need a gradient gets none)."""
    result: set[fx.Node] = set()
    for node in graph.nodes:
        if _role(node) == PARAM:
            result.add(node)
        elif node.op == "call_function" and node.target is not torch.ops.aten.detach.default:
            value = node.meta.get("val")
            if (isinstance(value, (tuple, list)) or _fx.is_differentiable(value)) and any(a in result for a in node.all_input_nodes):
                result.add(node)
    return result


@dataclass(frozen=True)
class _BufferUpdate:
    """A buffer the forward updates: its new value (a graph output), the position among the
    anchored nodes where the update runs, and the span of positions that read the buffer or
    update it, which one stage must hold (so that microbatch k reads what microbatch k-1 left)."""

    fqn: str
    value: fx.Node
    position: int
    span: tuple[int, int]


def _buffer_updates(traced: TracedModel, anchors: list[fx.Node]) -> list[_BufferUpdate]:
    """Where each buffer update of `traced` runs: at its new value's position when that depends
    on the inputs (BatchNorm statistics, an EMA of activations); otherwise (a counter) with the
    nodes that read the buffer, or, read by none, where the update was traced."""
    graph = traced.graph_module.graph
    values = graph.output_node().args[0][traced.results :]
    placeholders = {n.meta["zb_name"]: n for n in graph.find_nodes(op="placeholder") if _role(n) == BUFFER}
    position = {n: i for i, n in enumerate(anchors)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    where: dict[str, int] = {}
    for fqn, value in zip(traced.buffer_updates, values):
        if value in position:
            where[fqn] = position[value]
            continue
        traced_at = next((position[n] for n in anchors if order[n] > order[value]), max(len(anchors) - 1, 0))
        where[fqn] = min(_positions_reading(placeholders[fqn], position, {}), default=traced_at)
    unanchored = {}  # an unanchored new value -> the positions where it is computed
    for fqn, value in zip(traced.buffer_updates, values):
        if value not in position:
            unanchored.setdefault(value, set()).add(where[fqn])
    updates = []
    for fqn, value in zip(traced.buffer_updates, values):
        touching = _positions_reading(placeholders[fqn], position, unanchored) | {where[fqn]}
        updates.append(_BufferUpdate(fqn, value, where[fqn], (min(touching), max(touching))))
    return updates


def _positions_reading(node: fx.Node, position: dict[fx.Node, int], unanchored: dict[fx.Node, set[int]]) -> set[int]:
    """Positions of the anchored nodes that read `node`'s value, directly or through unanchored
    nodes (which each stage computes where it needs them), and of the unanchored nodes among
    those in `unanchored` (by where they are computed)."""
    result: set[int] = set()
    seen, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        result |= unanchored.get(current, set())
        for user in current.users:
            if user in position:
                result.add(position[user])
            elif user.op == "call_function":
                frontier.append(user)
    return result


# --- choosing the cuts -------------------------------------------------------------------------


def _boundary_values(anchors: list[fx.Node], graph: fx.Graph, results: Sequence[fx.Node] = ()) -> list[tuple[fx.Node, int, int]]:
    """(value, first position it can cross, last position that reads it) for every tensor
    value an anchored node reads from an earlier position, and every one of the graph's
    `results` (which the last stage returns: read at the last position). Inputs live from
    position 0; targets never cross (they enter the last stage directly)."""
    position = {n: i for i, n in enumerate(anchors)}
    returned = set(results)
    result = []
    for node in graph.nodes:
        if _role(node) == INPUT:
            start = 0
        elif node in position and not _fx.is_multi_output(node):
            start = position[node] + 1
        else:
            continue
        uses = [position[u] for u in node.users if u in position] + ([len(anchors) - 1] if node in returned else [])
        if uses and max(uses) >= start:
            result.append((node, start, max(uses)))
    return result


def _live_bytes(anchors: list[fx.Node], graph: fx.Graph) -> list[int]:
    """live_bytes[i]: bytes of values made before anchors[i] and read at or after it."""
    delta = [0] * (len(anchors) + 2)
    for node, start, last in _boundary_values(anchors, graph):
        size = _fx.node_bytes(node)
        delta[start] += size
        delta[last + 1] -= size
    live, running = [], 0
    for i in range(len(anchors) + 1):
        running += delta[i]
        live.append(running)
    return live


def _prefix_sums(costs: list[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return prefix


def _min_bottleneck(prefix: list[float], allowed: list[int], stages: int) -> float:
    """Smallest cap such that the sequence splits into at most `stages` runs at allowed cuts
    with every run costing at most cap (bisection over a greedy feasibility test)."""
    total = prefix[-1]
    n = len(prefix) - 1

    def runs_needed(cap: float) -> int:
        start, count = 0, 1
        while prefix[n] - prefix[start] > cap:
            # the furthest allowed cut within reach of `start`
            reach = bisect.bisect_right(prefix, prefix[start] + cap) - 1
            k = bisect.bisect_right(allowed, reach) - 1
            if k < 0 or allowed[k] <= start:
                return stages + 1
            start, count = allowed[k], count + 1
        return count

    low, high = 0.0, total
    for _ in range(64):
        mid = (low + high) / 2
        if runs_needed(mid) <= stages:
            high = mid
        else:
            low = mid
    return high


def _balanced_cuts(
    costs: list[float], live_bytes: list[int], allowed: list[int], stages: int, tolerance: float
) -> list[int]:
    """stages-1 cuts: every stage within (1 + tolerance) of the best bottleneck; among those,
    the fewest boundary bytes, then the most even stages (sum of squared stage costs)."""
    if stages == 1:
        return []
    prefix = _prefix_sums(costs)
    cap = _min_bottleneck(prefix, allowed, stages) * (1 + tolerance) + 1e-9
    points = [0, *allowed, len(costs)]  # where a stage may start; the last entry is the end
    starts = np.array([prefix[p] for p in points])
    # the best prefix ending at points[j]: its boundary bytes, then its sum of squared stage costs
    # (infinite: none); each candidate window is scanned with numpy, ties going to the first i
    best_bytes = np.full(len(points), np.inf)
    best_squares = np.full(len(points), np.inf)
    best_bytes[0] = best_squares[0] = 0.0
    parents: list[list[int]] = []
    for round_ in range(stages):
        last_round = round_ == stages - 1
        new_bytes, new_squares = np.full(len(points), np.inf), np.full(len(points), np.inf)
        parent = [-1] * len(points)
        lo = 0
        for j in range(1, len(points)):
            if last_round and j != len(points) - 1:
                continue
            while prefix[points[j]] - prefix[points[lo]] > cap:
                lo += 1
            if lo >= j:
                continue
            fewest = best_bytes[lo:j].min()
            if fewest == np.inf:
                continue
            run = starts[j] - starts[lo:j]
            squares = np.where(best_bytes[lo:j] == fewest, best_squares[lo:j] + run * run, np.inf)
            k = int(np.argmin(squares))
            boundary = 0 if last_round else live_bytes[points[j]]
            new_bytes[j], new_squares[j] = fewest + boundary, squares[k]
            parent[j] = lo + k
        best_bytes, best_squares = new_bytes, new_squares
        parents.append(parent)
    j = len(points) - 1
    if best_bytes[j] == np.inf:
        raise ValueError("no balanced cut found; pass split_points to choose the stages yourself")
    cuts = []
    for parent in reversed(parents):
        j = parent[j]
        cuts.append(points[j])
    return sorted(cuts)[1:]  # the first entry is the model's start


def _cuts_at_split_points(
    anchors: list[fx.Node], allowed: list[int], split_points: list[str], stages: int, updates: Sequence[_BufferUpdate] = ()
) -> list[int]:
    if len(split_points) != stages - 1:
        raise ValueError(
            f"split_points names {len(split_points)} module(s) where a stage begins, so it makes "
            f"{len(split_points) + 1} stages, but stages={stages}; pass {stages - 1} split points."
        )
    cuts = []
    modules_seen = sorted({n.meta.get("custom", {}).get("module", "") for n in anchors} - {""})
    for point in split_points:
        position = next(
            (
                i
                for i, n in enumerate(anchors)
                if _inside(n.meta.get("custom", {}).get("module", ""), point)
            ),
            None,
        )
        if position is None:
            raise ValueError(
                f"split point '{point}' names no module that runs on the model's inputs; "
                f"modules seen while tracing include {modules_seen[:12]}"
            )
        if position == 0:
            raise ValueError(
                f"split point '{point}' is where the model starts, so stage 0 would be empty; name the "
                "module where the second stage begins"
            )
        held = next((u for u in updates if u.span[0] < position <= u.span[1]), None)
        if held is not None:
            first, last = held.span
            inside = list(dict.fromkeys(m for n in anchors[first + 1 : last + 1] if (m := _module_of(n))))
            raise ValueError(
                f"split point '{point}' would put the reads and the update of buffer '{held.fqn}', which the "
                "forward updates in place, on two stages; one stage must hold them so that each microbatch "
                f"reads the value the previous one left. Choose a split point that is none of the modules "
                f"running between them: {inside}."
            )
        if position not in allowed:
            raise ValueError(
                f"split point '{point}' would cut inside an operation with several outputs or "
                "before the loss reads its target; choose a module boundary earlier in the model."
            )
        if cuts and position <= cuts[-1]:
            raise ValueError(
                f"split point '{point}' does not come after the previous split point; list split "
                "points in the order the modules run."
            )
        cuts.append(position)
    return cuts


def _module_of(node: fx.Node) -> str:
    return node.meta.get("custom", {}).get("module", "")


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# --- building the stage graphs -----------------------------------------------------------------


def _build_stages(
    traced: TracedModel,
    anchors: list[fx.Node],
    stage_of: dict[fx.Node, int],
    bounds: list[int],
    live_bytes: list[int],
    updates: Sequence[_BufferUpdate] = (),
) -> StagePartition:
    graph = traced.graph_module.graph
    paths = _state_attribute_paths([*traced.param_fqns, *traced.buffer_fqns])
    root = _state_module(traced, paths)
    stages_count = len(bounds) - 1
    differentiable = _requires_grad(graph)
    results = list(graph.output_node().args[0][: traced.results])  # the loss, or the model's outputs

    def producer_stage(node: fx.Node) -> int:
        return 0 if _role(node) == INPUT else stage_of[node]

    # boundary: stage k receives every value produced before it and read by a later stage
    crossing: list[list[fx.Node]] = [[] for _ in range(stages_count)]
    for node, _, _ in _boundary_values(anchors, graph, results):
        readers = [stage_of[u] for u in node.users if u in stage_of] + ([stages_count - 1] if node in results else [])
        for k in range(producer_stage(node) + 1, max(readers) + 1):
            crossing[k].append(node)

    dependencies = _dependency_graph(graph)
    anchored = set(anchors) | {n for n in graph.nodes if _role(n) in (INPUT, TARGET)}
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
        stage_inputs = [n for n in crossing[k]] if k > 0 else [n for n in graph.nodes if _role(n) == INPUT]
        boundary_reads = [n for n in read_inputs if _role(n) != TARGET]
        targets = [n for n in read_inputs if _role(n) == TARGET]
        missing = [n for n in boundary_reads if n not in stage_inputs]
        assert not missing, f"stage {k} reads {missing} that never reach it"
        next_inputs = crossing[k + 1] if k + 1 < stages_count else []
        produced_out = [n for n in next_inputs if n in own_set]
        relays = [n for n in next_inputs if n not in own_set]
        graph_outputs = produced_out if k + 1 < stages_count else results

        params = [n for n in graph.nodes if n in free and _role(n) == PARAM]
        buffers = [n for n in graph.nodes if n in free and _role(n) == BUFFER]
        elsewhere = {b.meta["zb_name"] for b in buffers} & ({u.fqn for u in updates} - {u.fqn for u in mine})
        assert not elsewhere, f"stage {k} reads buffers {sorted(elsewhere)} that another stage updates"
        constants = [n for n in graph.nodes if n in free and n.op == "get_attr"]
        for p in params:
            shared.setdefault(p.meta["zb_name"], []).append(k)

        new_graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in [*boundary_reads, *targets]:
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
        module = _fx.finish(new_graph, root, name=f"Stage{k}")
        stages.append(
            Stage(
                index=k,
                module=module,
                inputs=tuple(_value_name(n) for n in stage_inputs),
                outputs=tuple(_value_name(n) for n in next_inputs),
                relays=tuple(_value_name(n) for n in relays),
                graph_inputs=tuple(_value_name(n) for n in [*boundary_reads, *targets]),
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
        values[_value_name(node)] = ValueInfo(
            tuple(value.shape), tuple(value.stride()), value.dtype, node in differentiable and _fx.is_differentiable(value)
        )
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
        if _role(node) in (PARAM, BUFFER) or node.op == "get_attr" or (node.op == "call_function" and node not in anchored):
            free.add(node)
            frontier.extend(dependencies.predecessors(node))
    return free

