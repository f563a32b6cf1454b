"""Edits of a rank's row of actions (action ids of a ``fastsim.Evaluator``) that keep every
dependency: a W only moves later than its own I and never past another W of its stage, since
nothing waits for a W. zb-auto's search (``search.py``) and the heuristic (``heuristic.py``) use them.
"""

from __future__ import annotations

import random
from typing import Sequence

from .costs import memory_ceiling
from .fastsim import Evaluator


def fill_gaps(ev: Evaluator, row: list[int], end: list[float], fraction: float) -> list[int]:
    """A copy of ``row`` in which every idle gap at least ``fraction`` of a W long gets the next
    pending W (one whose I ran before the gap), moved forward from later in the row."""
    dur, local, first_w = ev.dur, ev.local, ev.first_w
    out = list(row)
    i = 1
    done = set(out[:1])
    while i < len(out):
        a = out[i]
        gap = end[a] - dur[a] - end[out[i - 1]] if end[out[i - 1]] >= 0 else 0.0
        if gap > 1e-6:
            for j in range(i, len(out)):
                b = out[j]
                if b >= first_w:
                    if local[b] in done and gap >= fraction * dur[b]:
                        out.insert(i, out.pop(j))
                        end[b] = -1.0  # its time is unknown now; do not fill before it again
                    break
        done.add(out[i])
        i += 1
    return out


def move_one_w(ev: Evaluator, row: list[int], end: list[float], rng: random.Random) -> bool:
    """Change ``row`` in place by one move (``_Search.move_single_w``); False when none applies."""
    dur, local, first_w = ev.dur, ev.local, ev.first_w
    if rng.random() < 0.6:
        gaps = []
        for i in range(1, len(row)):
            gap = end[row[i]] - dur[row[i]] - end[row[i - 1]]
            if gap > 1e-6:
                gaps.append((gap, i))
        if not gaps:
            return False
        gaps.sort(reverse=True)
        _, i = gaps[0] if rng.random() < 0.5 else rng.choice(gaps)
        before = set(row[:i])
        for j in range(i, len(row)):
            a = row[j]
            if a >= first_w:
                if local[a] not in before:
                    return False
                row.insert(i, row.pop(j))
                return True
        return False
    ws = [i for i, a in enumerate(row) if a >= first_w]
    if not ws:
        return False
    i = rng.choice(ws)
    a = row[i]
    step = rng.choice((1, 1, 2, 3)) * (1 if rng.random() < 0.5 else -1)
    j = i
    while j != i + step:
        k = j + (1 if step > 0 else -1)
        if not 0 <= k < len(row):
            return False
        other = row[k]
        if other >= first_w and ev.stage_of(other) == ev.stage_of(a):  # another W of this stage: keep order
            return False
        if step < 0 and other == local[a]:  # not before its own I
            return False
        j = k
    row.insert(j, row.pop(i))
    return True


def make_room(ev: Evaluator, rows: Sequence[Sequence[int]], limits: Sequence[float]) -> list[list[int]] | None:
    """``rows`` with W passes moved earlier wherever an action would exceed its rank's limit (the
    pending W of each stage, in microbatch order, most memory freed first), or None when an action
    does not fit even with no W pending. Moving a W earlier (still after its I) keeps every
    dependency, since nothing waits for a W. Used for handcrafted orders when I raises memory."""
    mem, local, M, first_w = ev.mem, ev.local, ev.M, ev.first_w
    out_rows = []
    for row, lim in zip(rows, limits):
        lim = memory_ceiling(lim)
        moved: set[int] = set()
        done: set[int] = set()
        next_w: dict[int, int] = {}  # stage -> next W microbatch to run
        for s in sorted({ev.stage_of(a) for a in row}):
            next_w[s] = 0
        out: list[int] = []
        level = 0.0
        for a in row:
            if a in moved:
                continue
            while level + mem[a] > lim:
                pending = [ev.w_id(s, k) for s, k in next_w.items() if k < M and local[ev.w_id(s, k)] in done]
                if not pending:
                    return None
                w = min(pending, key=lambda x: mem[x])  # frees the most
                out.append(w); done.add(w); moved.add(w); level += mem[w]
                next_w[ev.stage_of(w)] += 1
            out.append(a); done.add(a); level += mem[a]
            if a >= first_w:
                next_w[ev.stage_of(a)] += 1
        out_rows.append(out)
    return out_rows
