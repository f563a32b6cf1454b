"""Pass: a compiled model as the cut decision sees it (`schedules/cut_units.CutUnits`): per
position (an anchored forward node, `cut_positions.anchored_nodes`) its F, I and W work, its
memory and the parameters it reads; the bytes a boundary crosses at each position; where a stage
may begin.

Work is known per stage and per *unit* of a stage (`unit_key`: the block an op belongs to,
`model.layers.7`, or the module outside any block, `lm_head`): statically from the FLOPs and bytes
of the nodes of each stage's F, I and W graphs, or measured (`runtime/tuning/block_timing.py`). A unit's
work is spread over the stage's positions of that unit in proportion to their forward FLOP-
equivalents (a unit a stage's graphs name that none of its positions does, over all of them).
Memory: each stage's M_B spread by the bytes its F keeps per unit, M_W in proportion to M_B.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from torch import fx

from zbcompile.passes.block_joint import block_of
from zbcompile.passes.cut_positions import allowed_cuts, anchored_nodes, buffer_updates, live_bytes_at, role
from zbcompile.passes.graph_cost import FLOPS_PER_BYTE, node_cost, node_flops, node_written_bytes
from zbcompile.passes.partition import StagePartition
from zbcompile.passes.trace import ROLE_PARAM, TracedModel
from zbcompile.schedules.cut_units import CutUnits
from zbcompile.value_names import SAVED

KINDS = ("F", "I", "W")
Work = tuple[float, float]  # (FLOPs, bytes written)


def unit_key(node: fx.Node) -> str:
    """The unit an op belongs to: its block (`block_joint.block_of`), else its module's FQN
    ("" for the model's own ops and the loss)."""
    block = block_of(node)
    return block if block is not None else node.meta.get("custom", {}).get("module", "")


@dataclass(frozen=True)
class CutLayout:
    """The traced forward's positions and the compile's cut of them: per position its unit
    (`keys`), forward FLOP-equivalents (`weights`) and written bytes; `crossing` bytes at each
    position (0..n), `allowed` cut positions, `params` (FQN, bytes, reading positions) per
    parameter, `bounds` of the compile's stages (0, its cuts, n)."""

    keys: tuple[str, ...]
    weights: tuple[float, ...]
    written: tuple[float, ...]
    crossing: tuple[float, ...]
    allowed: tuple[int, ...]
    params: tuple[tuple[str, float, tuple[int, ...]], ...]
    bounds: tuple[int, ...]

    @property
    def positions(self) -> int:
        return len(self.keys)

    def stage_of(self, position: int) -> int:
        return next(k for k in range(len(self.bounds) - 1) if position < self.bounds[k + 1])


def cut_layout(traced: TracedModel, partition: StagePartition) -> CutLayout:
    """The positions of `traced`'s forward and where `partition` cut them."""
    graph = traced.graph_module.graph
    anchors = anchored_nodes(graph)
    updates = buffer_updates(traced, anchors)
    allowed = allowed_cuts(anchors, [u.span for u in updates])
    crossing = live_bytes_at(anchors, graph)
    positions = {n: i for i, n in enumerate(anchors)}
    readers: dict[str, set[int]] = defaultdict(set)
    free: dict[fx.Node, frozenset[str]] = {}
    for node in graph.nodes:  # the parameters each node reads through input-independent nodes
        if role(node) == ROLE_PARAM:
            free[node] = frozenset({node.meta["zb_name"]})
        elif node.op == "call_function" and node not in positions:
            free[node] = frozenset().union(*(free.get(a, frozenset()) for a in node.all_input_nodes))
        elif node in positions:
            for fqn in frozenset().union(*(free.get(a, frozenset()) for a in node.all_input_nodes)):
                readers[fqn].add(positions[node])
    state = traced.fake_state
    params = tuple(
        (fqn, float(state[fqn].numel() * state[fqn].element_size()), tuple(sorted(readers[fqn])))
        for fqn in traced.param_fqns
        if readers.get(fqn)
    )
    return CutLayout(
        keys=tuple(unit_key(n) for n in anchors),
        weights=tuple(float(node_cost(n)) for n in anchors),
        written=tuple(float(node_written_bytes(n)) for n in anchors),
        crossing=tuple(float(b) for b in crossing),
        allowed=tuple(allowed),
        params=params,
        bounds=(0, *partition.cuts, len(anchors)),
    )


def graph_work(graph_module: fx.GraphModule) -> dict[str, Work]:
    """Per unit, the FLOPs and bytes written of a graph's ops."""
    work: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            entry = work[unit_key(node)]
            entry[0] += node_flops(node)
            entry[1] += node_written_bytes(node)
    return {key: (flops, written) for key, (flops, written) in work.items()}


def saved_bytes(program) -> dict[str, float]:
    """Per unit, the bytes of the values a stage program's F keeps for the backward."""
    forward = program.joint.forward
    outputs = forward.graph.graph.output_node().args[0]
    kept: dict[str, float] = defaultdict(float)
    for name, node in zip(forward.signature.outputs, outputs):
        if name.startswith(SAVED) and isinstance(node, fx.Node):
            kept[unit_key(node)] += node_written_bytes(node) or _value_bytes(node)
    return dict(kept)


def _value_bytes(node: fx.Node) -> float:
    value = node.meta.get("val")
    return float(value.numel() * value.element_size()) if hasattr(value, "numel") else 0.0


def rename_units(layout: CutLayout, stage: int, source: int) -> Callable[[str], str]:
    """Where stage `stage` reuses stage `source`'s programs (`compiler.CostedPipeline`), the unit
    of `stage` each of `source`'s units stands for: matched in order of first appearance."""
    if stage == source:
        return lambda key: key

    def order(k: int) -> list[str]:
        return list(dict.fromkeys(layout.keys[layout.bounds[k] : layout.bounds[k + 1]]))

    mapping = dict(zip(order(source), order(stage)))
    return lambda key: mapping.get(key, key)


def spread(layout: CutLayout, stage: int, amounts: Mapping[str, float]) -> dict[int, float]:
    """`amounts` by unit spread over `stage`'s positions of that unit by forward weight (see the
    module docstring)."""
    start, end = layout.bounds[stage], layout.bounds[stage + 1]
    members: dict[str, list[int]] = defaultdict(list)
    for p in range(start, end):
        members[layout.keys[p]].append(p)
    result: dict[int, float] = defaultdict(float)
    for key, amount in amounts.items():
        targets = members.get(key) or list(range(start, end))
        weights = [layout.weights[p] for p in targets]
        total = sum(weights)
        for p, weight in zip(targets, weights):
            result[p] += amount * (weight / total if total > 0 else 1 / len(targets))
    return result


def per_position(layout: CutLayout, per_stage: Sequence[Mapping[str, float]]) -> list[float]:
    """One value per position from per-stage amounts by unit (`spread`)."""
    values = [0.0] * layout.positions
    for stage, amounts in enumerate(per_stage):
        for p, amount in spread(layout, stage, amounts).items():
            values[p] += amount
    return values


def memory_per_position(
    layout: CutLayout, programs: Sequence, representative: Sequence[int] = ()
) -> tuple[list[float], list[float]]:
    """(M_B, M_W) bytes per position: each stage's M_B spread by what its F keeps per unit, its
    M_W in proportion (stage sums equal the compile's M_B and M_W). `representative`: see
    `static_units`."""
    mem_b, mem_w = [0.0] * layout.positions, [0.0] * layout.positions
    representative = list(representative) or list(range(len(programs)))
    for stage, source in enumerate(representative):
        program, rename = programs[source], rename_units(layout, stage, source)
        kept = {rename(k): b for k, b in saved_bytes(program).items()} or {layout.keys[layout.bounds[stage]]: 1.0}
        spread_b = spread(layout, stage, kept)
        total = sum(spread_b.values()) or 1.0
        for p, amount in spread_b.items():
            mem_b[p] += program.cost.mem_b * amount / total
            mem_w[p] += program.cost.mem_w * amount / total
    return mem_b, mem_w


def program_work(program, rename: Callable[[str], str] = lambda key: key) -> dict[str, dict[str, Work]]:
    """By kind (F, I, W): per unit, the FLOPs and bytes of a stage program's graphs."""
    graphs = {"F": program.joint.forward, "I": program.split.input_backward, "W": program.split.weight_backward}
    return {
        kind: {rename(key): work for key, work in graph_work(program_.graph).items()}
        for kind, program_ in graphs.items()
    }


# seconds of `work` (FLOPs, bytes) for one pass kind on one rank
RankTime = Callable[[str, float, float], float]


def static_units(
    layout: CutLayout, programs: Sequence, rank_time: Sequence[RankTime], representative: Sequence[int] = ()
) -> CutUnits:
    """The model's `CutUnits` from the static work of each stage's graphs, timed on each rank by
    `rank_time[r]` (ranks given the same function share one computation). `representative[s]`:
    the stage whose programs stage s reuses (`compiler.CostedPipeline`; default: its own)."""
    representative = list(representative) or list(range(len(programs)))
    works = [
        program_work(programs[source], rename_units(layout, stage, source))
        for stage, source in enumerate(representative)
    ]
    flops = {k: per_position(layout, [{u: w[0] for u, w in work[k].items()} for work in works]) for k in KINDS}
    written = {k: per_position(layout, [{u: w[1] for u, w in work[k].items()} for work in works]) for k in KINDS}
    timed: dict[int, tuple] = {}
    times = []
    for time_of in rank_time:
        if id(time_of) not in timed:
            timed[id(time_of)] = tuple(
                tuple(time_of(k, f, b) for f, b in zip(flops[k], written[k])) for k in KINDS
            )
        times.append(timed[id(time_of)])
    mem_b, mem_w = memory_per_position(layout, programs, representative)
    transient = transient_per_position(layout, [programs[s].cost for s in representative])
    return units_of(layout, times, mem_b, mem_w, transient)


def transient_per_position(layout: CutLayout, costs: Sequence) -> list[float]:
    """Bytes per position of each stage's largest action peak beyond its microbatch's M_B or M_W
    (`StageGraphCost.action_peaks`), spread by the parameter bytes each position reads (what a W
    holds while it runs is mostly its weights' gradients), or by weight where none."""
    param_bytes = [0.0] * layout.positions
    for _, nbytes, positions in layout.params:
        for p in positions:
            param_bytes[p] += nbytes / len(positions)
    values = [0.0] * layout.positions
    for stage, cost in enumerate(costs):
        excess = max(0.0, max(cost.action_peaks.values(), default=0) - max(cost.mem_b, cost.mem_w))
        span = range(layout.bounds[stage], layout.bounds[stage + 1])
        weights = [param_bytes[p] for p in span]
        if not sum(weights):
            weights = [layout.weights[p] for p in span]
        total = sum(weights) or 1.0
        for p, weight in zip(span, weights):
            values[p] += excess * weight / total
    return values


def units_of(
    layout: CutLayout, times: Sequence, mem_b: Sequence[float], mem_w: Sequence[float], transient: Sequence[float] = ()
) -> CutUnits:
    """`CutUnits` of `layout` with per-rank (F, I, W) `times`, per-position memory and transients."""
    return CutUnits(
        times=tuple(tuple(tuple(kind) for kind in rank) for rank in times),
        mem_b=tuple(mem_b),
        mem_w=tuple(mem_w),
        crossing=layout.crossing,
        allowed=layout.allowed,
        params=tuple((nbytes, positions) for _, nbytes, positions in layout.params),
        preferred=tuple(layout.bounds[1:-1]),
        transient=tuple(transient),
    )


def flop_equivalents(kind: str, flops: float, written: float) -> float:
    """A `RankTime` in the compiler's FLOP-equivalents (`graph_cost.FLOPS_PER_BYTE`)."""
    return flops + FLOPS_PER_BYTE * written
