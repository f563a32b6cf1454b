"""Where the stages of a traced forward graph begin (`partition.py` builds them).

The *anchored* nodes (those that depend on a model input or the target, or draw random numbers)
in trace order are the sequence cut into stages; `allowed_cuts` gives the positions where a stage
may begin (a multi-output op stays with its getitems, a buffer's reads with its update, the
target's readers in the last stage). The cuts are chosen either by cost (`balanced_cuts`: the
smallest costliest stage, then the fewest bytes crossing boundaries, then the most even stages)
or at the modules the user names (`cuts_at_split_points`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from torch import fx

from zbcompile.passes import _fx
from zbcompile.passes.trace import ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, ROLE_TARGET, TracedModel

# --- classifying nodes -------------------------------------------------------------------------


def role(node: fx.Node) -> str | None:
    return node.meta.get("zb_role") if node.op == "placeholder" else None


def anchored_nodes(graph: fx.Graph) -> list[fx.Node]:
    """call_function nodes that depend on an input or target, or draw random numbers; in trace
    order."""
    anchored: set[fx.Node] = set()
    order = []
    for node in graph.nodes:
        if role(node) in (ROLE_INPUT, ROLE_TARGET):
            anchored.add(node)
        elif node.op == "call_function" and (
            any(a in anchored for a in node.all_input_nodes) or _fx.is_random(node)
        ):
            anchored.add(node)
            order.append(node)
    return order


def _target_dependent(graph: fx.Graph) -> set[fx.Node]:
    dependent = {n for n in graph.nodes if role(n) == ROLE_TARGET}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def allowed_cuts(anchors: list[fx.Node], together: Sequence[tuple[int, int]] = ()) -> list[int]:
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


@dataclass(frozen=True)
class BufferUpdate:
    """A buffer the forward updates: its new value (a graph output), the position among the
    anchored nodes where the update runs, and the span of positions that read the buffer or
    update it, which one stage must hold (so that microbatch k reads what microbatch k-1 left)."""

    fqn: str
    value: fx.Node
    position: int
    span: tuple[int, int]


def buffer_updates(traced: TracedModel, anchors: list[fx.Node]) -> list[BufferUpdate]:
    """Where each buffer update of `traced` runs: at its new value's position when that depends
    on the inputs (BatchNorm statistics, an EMA of activations); otherwise (a counter) with the
    nodes that read the buffer, or, read by none, where the update was traced."""
    graph = traced.graph_module.graph
    values = graph.output_node().args[0][traced.results :]
    placeholders = {n.meta["zb_name"]: n for n in graph.find_nodes(op="placeholder") if role(n) == ROLE_BUFFER}
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
        updates.append(BufferUpdate(fqn, value, where[fqn], (min(touching), max(touching))))
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
def cuts_keeping_params(
    anchors: list[fx.Node], allowed: list[int], live_bytes: list[int], stage_params: Sequence[frozenset[str]],
    preferred: Sequence[int] | None = None,
) -> list[int]:
    """Cuts of this graph under which every stage reads the parameters `stage_params[k]` says
    (each parameter read by one stage reads there; a parameter several stages read, a tied weight,
    may go anywhere): the same cut as an earlier compile's, in a trace of the same model whose
    nodes differ (another batch shape, symbolic sizes). Among the cuts that do, `preferred`'s
    positions where they qualify, else the fewest bytes crossing. Raises ValueError where none does."""
    graph = anchors[0].graph
    position = {n: i for i, n in enumerate(anchors)}
    reads = {
        n.meta["zb_name"]: _positions_reading(n, position, {}) for n in graph.find_nodes(op="placeholder")
        if role(n) == ROLE_PARAM
    }
    owner = {}
    for k, params in enumerate(stage_params):
        for fqn in params:
            owner[fqn] = None if fqn in owner else k  # None: read by several stages
    cuts = []
    for k in range(1, len(stage_params)):
        before = [max(reads[f]) + 1 for f, o in owner.items() if o is not None and o < k and reads.get(f)]
        after = [min(reads[f]) for f, o in owner.items() if o is not None and o >= k and reads.get(f)]
        low, high = max(before + [cuts[-1] + 1 if cuts else 1]), min(after + [len(anchors) - 1])
        candidates = [c for c in allowed if low <= c <= high]
        if not candidates:
            raise ValueError(f"no cut of this graph gives stage {k} the parameters it held in the earlier compile")
        wanted = preferred[k - 1] if preferred is not None and len(preferred) >= k else None
        cuts.append(wanted if wanted in candidates else min(candidates, key=lambda c: (live_bytes[c], c)))
    return cuts




def boundary_values(
    anchors: list[fx.Node], graph: fx.Graph, results: Sequence[fx.Node] = ()
) -> list[tuple[fx.Node, int, int]]:
    """(value, first position it can cross, last position that reads it) for every tensor
    value an anchored node reads from an earlier position, and every one of the graph's
    `results` (which the last stage returns: read at the last position). Inputs live from
    position 0; targets never cross (they enter the last stage directly)."""
    position = {n: i for i, n in enumerate(anchors)}
    returned = set(results)
    result = []
    for node in graph.nodes:
        if role(node) == ROLE_INPUT:
            start = 0
        elif node in position and not _fx.is_multi_output(node):
            start = position[node] + 1
        else:
            continue
        uses = [position[u] for u in node.users if u in position] + ([len(anchors) - 1] if node in returned else [])
        if uses and max(uses) >= start:
            result.append((node, start, max(uses)))
    return result


def live_bytes_at(anchors: list[fx.Node], graph: fx.Graph) -> list[int]:
    """live_bytes[i]: bytes of values made before anchors[i] and read at or after it."""
    delta = [0] * (len(anchors) + 2)
    for node, start, last in boundary_values(anchors, graph):
        size = _fx.node_bytes(node)
        delta[start] += size
        delta[last + 1] -= size
    live, running = [], 0
    for i in range(len(anchors) + 1):
        running += delta[i]
        live.append(running)
    return live


def prefix_sums(costs: list[float]) -> list[float]:
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


def balanced_cuts(
    costs: list[float], live_bytes: list[int], allowed: list[int], stages: int, tolerance: float
) -> list[int]:
    """stages-1 cuts: every stage within (1 + tolerance) of the best bottleneck; among those,
    the fewest boundary bytes, then the most even stages (sum of squared stage costs)."""
    if stages == 1:
        return []
    prefix = prefix_sums(costs)
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


def cuts_at_split_points(
    anchors: list[fx.Node], allowed: list[int], split_points: list[str], stages: int,
    updates: Sequence[BufferUpdate] = (),
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
