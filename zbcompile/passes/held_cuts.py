"""Cut a traced graph where each stage reads only the parameters and buffers its rank holds.

A second graph of a model already laid out on the ranks (the eval-mode forward of a model
trained in a pipeline: dropout gone, BatchNorm reading its running statistics) cannot reuse the
first graph's cut positions, which count nodes that differ between the two. It is cut by what
the ranks hold instead: every anchored node may run on the stages whose rank holds every
parameter and buffer it reads (`partition._free_ancestors`), and among the cuts that respect
that, the one whose costliest stage costs least (`graph_cost.node_cost`), as the partitioner
balances: bisection on that cost over a greedy test in which each stage reaches as far as it
may (stages that a rank holds side by side, as in a V, share its nodes by cost).
`held_cuts` returns the positions for `partition_stages(..., cuts=...)`.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from zbcompile.passes.cut_positions import allowed_cuts, anchored_nodes, buffer_updates, prefix_sums, role
from zbcompile.passes.graph_cost import node_cost
from zbcompile.passes.partition import _dependency_graph, _free_ancestors
from zbcompile.passes.trace import ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, ROLE_TARGET, TracedModel


def held_cuts(traced: TracedModel, held: Sequence[frozenset[str]]) -> tuple[int, ...]:
    """Cut positions (as `StagePartition.cuts`) for `len(held)` stages such that stage k reads
    only the FQNs in `held[k]` (what the rank running it holds). Raises ValueError, naming the
    node and what it reads, where no such cut exists."""
    graph = traced.graph_module.graph
    anchors = anchored_nodes(graph)
    allowed = allowed_cuts(anchors, [u.span for u in buffer_updates(traced, anchors)])
    dependencies = _dependency_graph(graph)
    anchored = set(anchors) | {n for n in graph.nodes if role(n) in (ROLE_INPUT, ROLE_TARGET)}
    stages, n = len(held), len(anchors)
    # refused[k][i]: the first position from i on whose node stage k may not run
    refused = [[n] * (n + 1) for _ in range(stages)]
    for i in range(n - 1, -1, -1):
        node = anchors[i]
        reads = {
            a.meta["zb_name"]
            for a in _free_ancestors([node], dependencies, anchored)
            if role(a) in (ROLE_PARAM, ROLE_BUFFER)
        }
        options = [k for k in range(stages) if reads <= held[k]]
        if not options:
            raise ValueError(
                f"node {node.name} (module '{node.meta.get('custom', {}).get('module', '')}') reads "
                f"{sorted(reads)[:4]}, "
                "which no one rank of the pipeline holds together; compile this model with split_points=[...] at "
                "module boundaries"
            )
        for k in range(stages):
            refused[k][i] = refused[k][i + 1] if k in options else i
    prefix = prefix_sums([node_cost(a) for a in anchors])
    # starts[k]: the positions (sorted) where stage k may begin with stages k.. covering the rest
    starts: list[list[int]] = [[] for _ in range(stages)]
    starts[-1] = [p for p in [0, *allowed] if refused[-1][p] == n]
    for k in range(stages - 2, -1, -1):
        after = starts[k + 1]
        for p in [0, *allowed] if k else [0]:
            first = bisect.bisect_right(after, p)
            if first < len(after) and after[first] <= refused[k][p]:
                starts[k].append(p)

    def cuts_within(cap: float) -> list[int] | None:
        """The cuts under which no stage costs more than `cap`, each stage reaching as far as the
        rest can still follow (None: there are none)."""
        cuts, start = [], 0
        for k in range(stages - 1):
            reach = min(refused[k][start], bisect.bisect_right(prefix, prefix[start] + cap) - 1)
            after = starts[k + 1]
            index = bisect.bisect_right(after, reach) - 1
            if index < 0 or after[index] <= start:
                return None
            start = after[index]
            cuts.append(start)
        return cuts if prefix[n] - prefix[start] <= cap else None

    if 0 not in starts[0]:
        raise ValueError(
            f"this graph cannot be cut into {stages} stages each reading only what its rank holds; compile the "
            "model with split_points=[...] at module boundaries"
        )
    low, high = 0.0, prefix[n]
    for _ in range(64):
        middle = (low + high) / 2
        low, high = (low, middle) if cuts_within(middle) is not None else (middle, high)
    return tuple(cuts_within(high))
