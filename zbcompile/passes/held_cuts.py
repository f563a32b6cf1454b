"""Cut a traced graph where each stage reads only the parameters and buffers its rank holds.

A second graph of a model already laid out on the ranks (the eval-mode forward of a model
trained in a pipeline: dropout gone, BatchNorm reading its running statistics) cannot reuse the
first graph's cut positions, which count nodes that differ between the two. It is cut by what
the ranks hold instead: every anchored node may run on the stages whose rank holds every
parameter and buffer it reads (`partition._free_ancestors`), and stage k begins right before the
first node that only stages k and later may run, or, where no node asks for it, as late as the
graph allows. `held_cuts` returns the positions for `partition_stages(..., cuts=...)`.
"""

from __future__ import annotations

from typing import Sequence

from zbcompile.passes.partition import (
    _allowed_cuts,
    _anchored_nodes,
    _buffer_updates,
    _dependency_graph,
    _free_ancestors,
    _role,
)
from zbcompile.passes.trace import BUFFER, INPUT, PARAM, TARGET, TracedModel


def held_cuts(traced: TracedModel, held: Sequence[frozenset[str]]) -> tuple[int, ...]:
    """Cut positions (as `StagePartition.cuts`) for `len(held)` stages such that stage k reads
    only the FQNs in `held[k]` (what the rank running it holds). Raises ValueError, naming the
    node and what it reads, where no such cut exists."""
    graph = traced.graph_module.graph
    anchors = _anchored_nodes(graph)
    allowed = set(_allowed_cuts(anchors, [u.span for u in _buffer_updates(traced, anchors)]))
    dependencies = _dependency_graph(graph)
    anchored = set(anchors) | {n for n in graph.nodes if _role(n) in (INPUT, TARGET)}
    stages = len(held)
    runs_on: list[list[int]] = []
    for node in anchors:
        reads = {n.meta["zb_name"] for n in _free_ancestors([node], dependencies, anchored) if _role(n) in (PARAM, BUFFER)}
        options = [k for k in range(stages) if reads <= held[k]]
        if not options:
            raise ValueError(
                f"node {node.name} (module '{node.meta.get('custom', {}).get('module', '')}') reads {sorted(reads)[:4]}, "
                "which no one rank of the pipeline holds together; compile this model with split_points=[...] at "
                "module boundaries"
            )
        runs_on.append(options)
    cuts: list[int] = []
    for k in range(1, stages):
        earliest = max((i + 1 for i, options in enumerate(runs_on) if max(options) < k), default=1)
        latest = min((i for i, options in enumerate(runs_on) if min(options) >= k), default=len(anchors) - 1)
        lower = max(earliest, cuts[-1] + 1 if cuts else 1)
        fitting = [p for p in allowed if lower <= p <= latest]
        if not fitting:
            raise ValueError(
                f"this graph cannot be cut before stage {k} so that each stage reads only what its rank holds "
                f"(positions {lower}..{latest}); compile the model with split_points=[...] at module boundaries"
            )
        cuts.append(max(fitting))
    bounds = [0, *cuts, len(anchors)]
    for k in range(stages):
        for i in range(bounds[k], bounds[k + 1]):
            if k not in runs_on[i]:
                raise ValueError(
                    f"node {anchors[i].name} falls in stage {k}, whose rank does not hold what it reads; compile the "
                    "model with split_points=[...] at module boundaries"
                )
    return tuple(cuts)
