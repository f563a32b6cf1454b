"""A fast evaluator for search: the simulator's timing on integer action ids.

The search in ``search.py`` re-times thousands of candidate orders, so this module works on plain
lists of ints instead of ``Action`` objects. An action is ``(kind * S + stage) * M + microbatch``
with kind 0 = F, 1 = I, 2 = W (split backward only), so every id from ``first_w`` on is a W. The
timing rule is ``timing.asap_timing``'s: every action starts as soon as its rank is free and its
inputs have arrived, in each rank's order, a cross-rank input delayed by ``comm``; a rank ends when
its last action and its stages' gradient reductions (``costs.reduce``, ``simulate.reduction_ends``)
have. ``tests/schedules/test_schedule_search.py`` checks that both agree.
"""

from __future__ import annotations

import math
from typing import Sequence

from .costs import ResolvedCosts, fits_memory
from .ir import Action, Schedule

KINDS = "FIW"
_KIND_INDEX = {"F": 0, "I": 1, "W": 2}


class Evaluator:
    """Per-rank spans, makespan and peak memory of F/I/W orders given as lists of action ids."""

    def __init__(self, stages: int, microbatches: int, stage_to_rank: Sequence[int], costs: ResolvedCosts):
        S, M = stages, microbatches
        self.S, self.M = S, M
        self.stage_to_rank = tuple(stage_to_rank)
        self.ranks = 1 + max(stage_to_rank)
        self.first_w = 2 * S * M  # the W ids are first_w .. 3 S M - 1
        n = 3 * S * M
        self.dur = [0.0] * n
        self.mem = [0.0] * n
        self.cross = [-1] * n  # producer on (possibly) another rank
        self.delay = [0.0] * n
        self.local = [-1] * n  # producer on the same stage
        self.reduce = tuple(costs.reduction(s) for s in range(S)) if costs.reduces else None
        self.stages_on = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(self.ranks)]
        for s in range(S):
            here = stage_to_rank[s]
            for k in range(M):
                f, i, w = self.id(s, 0, k), self.id(s, 1, k), self.id(s, 2, k)
                self.dur[f], self.dur[i], self.dur[w] = costs.f[s], costs.i[s], costs.w[s]
                self.mem[f] = costs.mem_b[s]
                self.mem[i] = -(costs.mem_b[s] - costs.mem_w[s])
                self.mem[w] = -costs.mem_w[s]
                if s > 0:
                    self.cross[f] = self.id(s - 1, 0, k)
                    self.delay[f] = costs.comm if stage_to_rank[s - 1] != here else 0.0
                if s < S - 1:
                    self.cross[i] = self.id(s + 1, 1, k)
                    self.delay[i] = costs.comm if stage_to_rank[s + 1] != here else 0.0
                self.local[i] = f
                self.local[w] = i

    def id(self, stage: int, kind: int, microbatch: int) -> int:
        return (kind * self.S + stage) * self.M + microbatch

    def w_id(self, stage: int, microbatch: int) -> int:
        return self.first_w + stage * self.M + microbatch

    def stage_of(self, aid: int) -> int:
        return (aid // self.M) % self.S

    def action(self, aid: int) -> Action:
        rest, k = divmod(aid, self.M)
        kind, s = divmod(rest, self.S)
        return Action(s, KINDS[kind], k)

    def rows_of(self, schedule: Schedule) -> list[list[int]]:
        return [
            [self.id(a.stage, _KIND_INDEX[a.kind], a.microbatch) for a in row if a.is_compute]
            for row in schedule.actions
        ]

    def schedule(self, name: str, rows: Sequence[Sequence[int]], info=None) -> Schedule:
        actions = tuple(tuple(self.action(a) for a in row) for row in rows)
        return Schedule(name, self.S, self.M, self.stage_to_rank, actions, info or {})

    def times(
        self, rows: Sequence[Sequence[int]], end: list[float] | None = None
    ) -> tuple[list[float], list[float]] | None:
        """Per-rank (first start, last end), or None when the programs cannot finish. ``end``, when
        given (a list of len 3 S M), receives every action's end time."""
        dur, cross, delay, local = self.dur, self.cross, self.delay, self.local
        if end is None:
            end = [-1.0] * len(dur)
        else:
            end[:] = [-1.0] * len(dur)
        R = len(rows)
        pos = [0] * R
        free = [0.0] * R
        first = [0.0] * R
        lengths = [len(r) for r in rows]
        progress = True
        while progress:
            progress = False
            for r in range(R):
                i = pos[r]
                n = lengths[r]
                if i >= n:
                    continue
                row = rows[r]
                t = free[r]
                start_i = i
                while i < n:
                    a = row[i]
                    ready = t
                    c = cross[a]
                    if c >= 0:
                        e = end[c]
                        if e < 0:
                            break
                        e += delay[a]
                        if e > ready:
                            ready = e
                    c = local[a]
                    if c >= 0:
                        e = end[c]
                        if e < 0:
                            break
                        if e > ready:
                            ready = e
                    if i == 0:
                        first[r] = ready
                    t = ready + dur[a]
                    end[a] = t
                    i += 1
                if i != start_i:
                    pos[r] = i
                    free[r] = t
                    progress = True
        if any(p < n for p, n in zip(pos, lengths)):
            return None
        if self.reduce is not None:
            free = [self._reduced(r, t, end) for r, t in enumerate(free)]
        return first, free

    def _reduced(self, rank: int, last: float, end: Sequence[float]) -> float:
        """When ``rank`` ends (its last action at ``last``) once its link has reduced its stages'
        gradients, each from its last W's end on, in the order those end."""
        link, first_w, M = 0.0, self.first_w, self.M
        for done, s in sorted((max(end[first_w + s * M : first_w + (s + 1) * M]), s) for s in self.stages_on[rank]):
            link = max(link, done) + self.reduce[s]
        return max(last, link)

    def peak(self, row: Sequence[int]) -> float:
        mem = self.mem
        level = peak = 0.0
        for a in row:
            level += mem[a]
            if level > peak:
                peak = level
        return peak

    def fits(self, rows: Sequence[Sequence[int]], limits: Sequence[float]) -> bool:
        """Whether every rank's peak fits its limit (``costs.fits_memory``)."""
        return all(fits_memory(self.peak(row), limit) for row, limit in zip(rows, limits))

    def score(self, rows: Sequence[Sequence[int]], objective: str) -> tuple[float, float]:
        """(objective, sum of per-rank spans) -- the second breaks ties in the search; inf if stuck."""
        timed = self.times(rows)
        if timed is None:
            return math.inf, math.inf
        first, last = timed
        spans = [b - a for a, b in zip(first, last)]
        if objective == "span":
            return max(spans), sum(spans)
        return max(last) - min(first), sum(spans)
