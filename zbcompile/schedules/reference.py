"""The zero-bubble paper's construction of its heuristic schedule (Qi et al., ICLR 2024, the
initial solution of its ILP), as one more zb-auto candidate.

It builds one stage order at a time, microbatch by microbatch, timing each action as it is placed
(the simulator's rule: start when the stage is free and the input has arrived, a cross-stage input
delayed by comm):
- warm-up: every stage places one F; then, from the last stage up, each stage plans as many F as
  fit in memory and keep it busy until the first gradient returns (with
  ``bubble_before_first_i`` the last of them may end after that), no more than the stage above plans
  (unless that would leave microbatches unplaced); then the first I on every stage, last stage first;
- steady state, per microbatch: every stage that still has forwards places one F (with
  ``prioritise_i`` a stage two or more F ahead of its downstream neighbour skips it when that
  neighbour's next F and I would otherwise wait for it: when an F (and the W memory needs first)
  would end after them, or the gap it leaves is within the largest bubble so far), no stage further
  than its downstream neighbour; then one I per stage, last stage first. Before each F or I: W
  while memory demands it, W while one fits before the input arrives, and one more W into the
  remaining gap when that gap would raise the stage's bubble above the largest so far (or always,
  with ``greedy_fill``);
- the first stage runs all pending W before its last I's once its forwards are done; every stage
  ends with its remaining W.
The three flags are grid-searched; ``reference_rows`` returns every variant that could be built.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from .costs import fits_memory
from .fastsim import Evaluator


class _NoRoom(Exception):
    pass


def _build(ev: Evaluator, limits: Sequence[float], bubble_before_first_i: bool, prioritise_i: bool, greedy_fill: bool):
    S, M = ev.S, ev.M
    dur, mem, delay = ev.dur, ev.mem, ev.delay
    count = [[0, 0, 0] for _ in range(S)]  # placed F, I, W per stage
    end_at = [0.0] * S  # the stage's last end
    level = [0.0] * S  # memory
    done = [0.0] * (3 * S * M)  # end time per action
    bubble = [0.0] * S
    rows: list[list[int]] = [[] for _ in range(S)]
    aid = ev.id  # (stage, kind, microbatch) -> evaluator id

    def put(s: int, kind: int) -> None:
        k = count[s][kind]
        a = aid(s, kind, k)
        finish = end_at[s] + dur[a]
        busy_end = finish
        if kind == 0 and s > 0:
            finish = max(finish, done[aid(s - 1, 0, k)] + delay[a] + dur[a])
        elif kind == 1 and s < S - 1:
            finish = max(finish, done[aid(s + 1, 1, k)] + delay[a] + dur[a])
        if count[s][0] > 0:
            bubble[s] += finish - busy_end
        end_at[s] = finish
        done[a] = finish
        level[s] += mem[a]
        count[s][kind] += 1
        rows[s].append(a)

    def w_pending(s: int) -> bool:
        return count[s][2] < count[s][1]

    def w_for_memory(s: int, need: float) -> None:
        while not fits_memory(level[s] + need, limits[s]):
            if not w_pending(s):
                raise _NoRoom
            put(s, 2)

    def w_before(s: int, arrival: float) -> None:
        """W while one ends before the input arrives; then maybe one more into the gap."""
        while w_pending(s) and end_at[s] + dur[aid(s, 2, count[s][2])] <= arrival:
            put(s, 2)
        if w_pending(s) and end_at[s] < arrival:
            if arrival - end_at[s] <= max(bubble) - bubble[s]:
                if greedy_fill:
                    put(s, 2)
            else:
                put(s, 2)

    for i in range(M):
        if i == 0:
            for s in range(S):
                put(s, 0)
            plan = [0] * S
            last = 0.0
            for s in range(S - 1, -1, -1):
                if s == S - 1:
                    last = done[aid(s, 0, 0)] + dur[aid(s, 1, 0)]
                    continue
                m_s, t_s = level[s], end_at[s]
                arrival = last + delay[aid(s, 1, 0)]
                while count[s][0] + plan[s] < M:
                    f = aid(s, 0, count[s][0] + plan[s])
                    if not fits_memory(m_s + mem[f], limits[s]):
                        break
                    if bubble_before_first_i:
                        if t_s + dur[f] > arrival:
                            break
                    elif t_s >= arrival:
                        break
                    m_s += mem[f]
                    t_s += dur[f]
                    plan[s] += 1
                last = max(t_s, arrival) + dur[aid(s, 1, 0)]
            for s in range(1, S):
                while plan[s] > 0 and plan[s] >= plan[s - 1] and count[s][0] + plan[s] < M:
                    plan[s] -= 1
            for s in range(S):
                for _ in range(plan[s]):
                    put(s, 0)
            for s in range(S - 1, -1, -1):
                w_for_memory(s, mem[aid(s, 1, 0)])
                put(s, 1)
            continue
        want = [0] * S
        for s in range(S):
            if count[s][0] >= M:
                continue
            if prioritise_i and s + 1 < S and count[s][0] >= count[s + 1][0] + 2:
                nxt = (
                    end_at[s + 1]
                    + dur[aid(s + 1, 0, count[s + 1][0])]
                    + dur[aid(s + 1, 1, count[s + 1][1])]
                    + delay[aid(s + 1, 1, 0)]
                )
                if end_at[s] >= nxt:
                    continue
                f = aid(s, 0, count[s][0])
                w_cost, w_n, m_s = 0.0, 0, level[s] + mem[f]
                while not fits_memory(m_s, limits[s]) and count[s][2] + w_n < count[s][1]:
                    w = aid(s, 2, count[s][2] + w_n)
                    w_cost += dur[w]
                    m_s += mem[w]
                    w_n += 1
                if end_at[s] + dur[f] + w_cost <= nxt:
                    want[s] = 1
                    continue
                if nxt - end_at[s] <= max(bubble) - bubble[s]:
                    continue
            want[s] = 1
        for s in range(S - 2, -1, -1):
            want[s] = min(want[s], want[s + 1])
        for s in range(S):
            if not want[s]:
                continue
            k = count[s][0]
            w_for_memory(s, mem[aid(s, 0, k)])
            if s > 0:
                w_before(s, done[aid(s - 1, 0, k)] + delay[aid(s, 0, k)])
            put(s, 0)
        for s in range(S - 1, -1, -1):
            w_for_memory(s, mem[aid(s, 1, i)])
            if s + 1 < S:
                w_before(s, done[aid(s + 1, 1, i)] + delay[aid(s, 1, i)])
            if s == 0 and count[s][0] == M:
                while w_pending(s):
                    put(s, 2)
            put(s, 1)
    for s in range(S):
        while count[s][2] < M:
            put(s, 2)
    return rows, [done[aid(s, 0, 0)] - dur[aid(s, 0, 0)] for s in range(S)], end_at


ALL_FLAGS = tuple(itertools.product((True, False), repeat=3))
QUICK_FLAGS = ((True, False, False), (True, True, True))  # the winners on the paper's profiles


def reference_rows(
    ev: Evaluator,
    limits: Sequence[float] | None,
    objective: str = "span",
    flags: Sequence[tuple[bool, bool, bool]] = ALL_FLAGS,
) -> tuple[str, list[list[int]]] | None:
    """The best flag combination of the paper's construction by its own timing (the simulator's
    rule, so the value is exact), labelled by its flags, or None when none could be built (one
    stage per rank only). Ties go to the earlier combination. Memory is checked again by the caller."""
    if ev.ranks != ev.S:
        return None
    lims = list(limits) if limits is not None else [math.inf] * ev.S
    best = None
    for index, fl in enumerate(flags):
        try:
            rows, first, last = _build(ev, lims, *fl)
        except _NoRoom:
            continue
        if any(len(r) != 3 * ev.M for r in rows):
            continue
        spans = [b - a for a, b in zip(first, last)]
        value = max(spans) if objective == "span" else max(last) - min(first)
        key = (value, sum(spans), index)
        if best is None or key < best[0]:
            best = (key, "reference " + "".join("1" if f else "0" for f in fl), rows)
    return None if best is None else (best[1], best[2])
