"""A memory-aware list scheduler: the paper's heuristic (section 3.1) as an event simulation.

Time advances from event to event (a rank becomes free, an input arrives). A free rank picks, in
this order:
1. an I whose inputs have arrived (it is on the critical path back to stage 0);
2. an F whose input has arrived and whose activations fit in memory ("warm up as many F as memory
   and the first B's return allow"); with ``f_gate="fit"`` only if it ends before the next known
   I arrives, so that F never delays a returning gradient;
3. a W when an F waits for memory (W frees M_W);
4. a W to fill the gap (``w_gate="fill"``), or only if it ends before the next known arrival
   (``w_gate="fit"``, keeping W in reserve for later gaps and the drain);
otherwise it waits. Works for any stage-to-rank placement (single chunk, V shape).

When ``mem_w > mem_b`` an I adds ``mem_w - mem_b``; an I that does not fit waits while W passes
free memory (a W of an earlier microbatch is then always pending, see below), and an F is admitted
only with room for that increase: level + mem_b + max(0, mem_w - mem_b) <= limit. On a
single-chunk stage this never deadlocks: let L0 be the level before the last F, admitted with
L0 + mem_b + e <= limit (e = max(0, mem_w - mem_b)), and q0 the W pending then. Since then a I and
b W ran; if no W is pending now, b = a + q0 and the level is
L0 + mem_b + a (mem_w - mem_b) - b mem_w = L0 + mem_b - a mem_b - q0 mem_w <= L0 + mem_b, so the I
fits. So an I that does not fit always finds a pending W of an earlier microbatch, and the only
infeasible limits are those below max(mem_b, mem_w) (``heuristic.minimum_memory``), rejected
before scheduling. Ranks holding several stages (V) keep a reserve for the deeper stages; if they
still get stuck, ``MemoryTooSmall`` says so and the caller tries other candidates.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .costs import ResolvedCosts, memory_ceiling, warmup_windows
from .ir import Action, Schedule

_EPS = 1e-9


@dataclass(frozen=True)
class GreedyPolicy:
    f_gate: str = "eager"  # "eager" | "fit"
    w_gate: str = "fill"  # "fill" | "fit"
    # Cap on F passes in flight per stage (F done, I not yet): None = memory only; k >= 0 = the
    # number of F that fit before the first gradient returns, plus k (the paper's warm-up count).
    inflight_extra: int | None = None


# Large problems try the two policies that win most often (fewest in-flight F first).
QUICK_POLICIES = (GreedyPolicy("eager", "fill", 0), GreedyPolicy("eager", "fit", 0))
POLICIES = (
    QUICK_POLICIES
    + tuple(GreedyPolicy("eager", w, extra) for extra in (None, 0, 1) for w in ("fill", "fit"))
    + (GreedyPolicy("fit", "fill", None),)
)


def warmup_counts(stages: int, stage_to_rank: Sequence[int], costs: ResolvedCosts) -> list[int]:
    """Per stage, how many F fit between its first F and the return of microbatch 0's gradient
    (``costs.warmup_windows``), rounded up, at least 1."""
    return [
        max(1, math.ceil(window / costs.f[s] - _EPS)) if costs.f[s] > 0 else 1
        for s, window in enumerate(warmup_windows(stage_to_rank, costs))
    ]


class MemoryTooSmall(ValueError):
    pass


class _ListScheduler:
    """The event simulation of one ``list_schedule`` call: per stage the F, I and W placed so
    far and their end times; per rank its memory level, when it is free and its program."""

    def __init__(
        self, stages: int, microbatches: int, stage_to_rank: Sequence[int], costs: ResolvedCosts,
        memory_limit: Sequence[float] | None, policy: GreedyPolicy,
    ):
        S, M = stages, microbatches
        self.S, self.M, self.stage_to_rank, self.costs, self.policy = S, M, stage_to_rank, costs, policy
        ranks = self.ranks = 1 + max(stage_to_rank)
        self.stages_of = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(ranks)]
        # F of deeper stages and I of deeper stages first (they are further along their chains).
        for group in self.stages_of:
            group.sort(reverse=True)
        self.shallow_first = [sorted(group) for group in self.stages_of]
        self.limit = list(memory_limit) if memory_limit is not None else [math.inf] * ranks
        self.ceiling = [memory_ceiling(l) for l in self.limit]
        self.f_end = [[math.inf] * M for _ in range(S)]
        self.i_end = [[math.inf] * M for _ in range(S)]
        self.nf, self.ni, self.nw = [0] * S, [0] * S, [0] * S
        self.free_at = [0.0] * ranks
        self.first_start = [math.inf] * ranks
        self.mem = [0.0] * ranks
        self.rows: list[list[Action]] = [[] for _ in range(ranks)]
        self.remaining = [3 * M * len(g) for g in self.stages_of]
        if policy.inflight_extra is None:
            self.inflight_cap = [M] * S
        else:
            self.inflight_cap = [c + policy.inflight_extra for c in warmup_counts(S, stage_to_rank, costs)]
        # Memory kept free on a rank for one F (and its I's increase) of each deeper stage it holds (V
        # shapes), so that the oldest microbatch can always continue down the pipeline and back, and
        # for the increase of this stage's own I (mem_w > mem_b).
        self.memory_delta = {kind: [costs.memory_delta(s, kind) for s in range(S)] for kind in "FIW"}
        self.reserve = [
            costs.excess(s)
            + sum(max(costs.mem_b[d], costs.mem_w[d]) for d in self.stages_of[stage_to_rank[s]] if d > s)
            for s in range(S)
        ]
        # the delay of stage s's F input (from s - 1) and of its I input (from s + 1)
        self.f_delay = [0.0] + [self.delay(s - 1, s) for s in range(1, S)]
        self.i_delay = [self.delay(s + 1, s) for s in range(S - 1)] + [0.0]
        self.events: list[tuple[float, int]] = [(0.0, r) for r in range(ranks)]
        heapq.heapify(self.events)

    def delay(self, a: int, b: int) -> float:
        return self.costs.comm if self.stage_to_rank[a] != self.stage_to_rank[b] else 0.0

    def f_avail(self, s: int) -> float:
        """When stage ``s``'s next F has its input."""
        return 0.0 if s == 0 else self.f_end[s - 1][self.nf[s]] + self.f_delay[s]

    def i_avail(self, s: int) -> float:
        """When stage ``s``'s next I has its inputs (inf before its F ran)."""
        k = self.ni[s]
        if k >= self.nf[s]:
            return math.inf
        if s == self.S - 1:
            return self.f_end[s][k]
        return max(self.f_end[s][k], self.i_end[s + 1][k] + self.i_delay[s])

    def place(self, r: int, s: int, kind: str, now: float) -> None:
        """Run the next ``kind`` of stage ``s`` on rank ``r`` at ``now``; queue the events it causes."""
        costs, events, stage_to_rank = self.costs, self.events, self.stage_to_rank
        if kind == "F":
            k = self.nf[s]
            self.nf[s] += 1
            end = now + costs.f[s]
            self.f_end[s][k] = end
            if s + 1 < self.S:
                heapq.heappush(events, (end + self.f_delay[s + 1], stage_to_rank[s + 1]))
        elif kind == "I":
            k = self.ni[s]
            self.ni[s] += 1
            end = now + costs.i[s]
            self.i_end[s][k] = end
            if s > 0:
                heapq.heappush(events, (end + self.i_delay[s - 1], stage_to_rank[s - 1]))
        else:
            k = self.nw[s]
            self.nw[s] += 1
            end = now + costs.w[s]
        self.rows[r].append(Action(s, kind, k))
        if now < self.first_start[r]:
            self.first_start[r] = now
        self.mem[r] += self.memory_delta[kind][s]
        self.free_at[r] = end
        self.remaining[r] -= 1
        heapq.heappush(events, (end, r))

    def forward_fits(self, r: int, s: int) -> bool:
        """Room on rank ``r`` for an F of stage ``s`` and its reserve."""
        return self.mem[r] + self.costs.mem_b[s] + self.reserve[s] <= self.ceiling[r]

    def forward_allowed(self, s: int) -> bool:
        """Stage ``s`` has forwards left and fewer in flight than its cap."""
        return self.nf[s] < self.M and self.nf[s] - self.ni[s] < self.inflight_cap[s]

    def decide(self, r: int, now: float) -> tuple[int, str] | None:
        """What rank ``r`` runs at ``now`` (the order of the module docstring), None to wait."""
        group = self.stages_of[r]
        returned = self.returned_gradient(group, now)
        if returned is not None:
            return self.backward(r, group, returned)
        nf, ni, cap, M, f_end, f_delay = self.nf, self.ni, self.inflight_cap, self.M, self.f_end, self.f_delay
        soon = now + _EPS
        ready_f = [  # forward_allowed(s) and f_avail(s) <= soon, inline: the list scheduler's hottest line
            s for s in group
            if nf[s] < M and nf[s] - ni[s] < cap[s] and (s == 0 or f_end[s - 1][nf[s]] + f_delay[s] <= soon)
        ]
        fits = [s for s in ready_f if self.forward_fits(r, s)] if ready_f else ready_f
        if fits and self.policy.f_gate == "eager":
            return fits[0], "F"
        if fits:
            next_i = self.next_i(group)
            for s in fits:
                if now + self.costs.f[s] <= next_i + _EPS:
                    return s, "F"
        return self.weight(r, group, now, ready_f, fits)

    def next_i(self, group: list[int]) -> float:
        """When the next I of ``group``'s stages has its inputs (inf: none known)."""
        return min((self.i_avail(s) for s in group if self.ni[s] < self.M), default=math.inf)

    def returned_gradient(self, group: list[int], now: float) -> int | None:
        """Step 1: the stage whose I has its inputs, oldest microbatch first, deeper stage on ties."""
        best = None
        ni, nf, M, last = self.ni, self.nf, self.M, self.S - 1
        f_end, i_end, i_delay = self.f_end, self.i_end, self.i_delay
        soon = now + _EPS
        for s in group:
            k = ni[s]
            if k >= M or k >= nf[s]:  # i_avail(s) is inf
                continue
            avail = f_end[s][k] if s == last else max(f_end[s][k], i_end[s + 1][k] + i_delay[s])
            if avail <= soon:
                key = (k, -s)
                if best is None or key < best[0]:
                    best = (key, s)
        return None if best is None else best[1]

    def backward(self, r: int, group: list[int], s: int) -> tuple[int, str] | None:
        """Step 1: the I of stage ``s``; when its increase (mem_w > mem_b) does not fit, first the
        pending W that frees the most."""
        if self.mem[r] + self.costs.memory_delta(s, "I") <= self.ceiling[r]:
            return s, "I"
        pending_w = [t for t in group if self.nw[t] < self.ni[t]]
        if pending_w:
            return max(pending_w, key=lambda t: (self.costs.mem_w[t], -t)), "W"
        return None  # cannot happen on a single-chunk stage (see the module docstring)

    def weight(
        self, r: int, group: list[int], now: float, ready_f: list[int], fits: list[int]
    ) -> tuple[int, str] | None:
        """Steps 3 and 4: a W of the shallowest stage with one pending, to make room for a waiting
        forward, or to fill the gap as the policy's ``w_gate`` allows."""
        w_stage = next((s for s in self.shallow_first[r] if self.nw[s] < self.ni[s]), None)
        if w_stage is None:
            return None
        if (ready_f and not fits) or self.policy.w_gate == "fill":
            return w_stage, "W"
        waiting = [s for s in group if self.forward_allowed(s) and self.forward_fits(r, s)]
        next_f = min((self.f_avail(s) for s in waiting), default=math.inf)
        upcoming = min(self.next_i(group), next_f)
        if fits or now + self.costs.w[w_stage] <= upcoming + _EPS or upcoming == math.inf:
            return w_stage, "W"
        return None

    def run(self) -> None:
        """Advance from event to event until no rank can act."""
        while self.events:
            now, r = heapq.heappop(self.events)
            if self.remaining[r] == 0 or self.free_at[r] > now + _EPS:
                continue
            choice = self.decide(r, now)
            if choice is not None:
                self.place(r, choice[0], choice[1], now)


def list_schedule(
    name: str, stages: int, microbatches: int, stage_to_rank: Sequence[int], costs: ResolvedCosts,
    memory_limit: Sequence[float] | None, policy: GreedyPolicy = GreedyPolicy(),
) -> Schedule:
    """Build per-rank programs (F, I, W) with ``policy``; raises MemoryTooSmall when stuck."""
    ls = _ListScheduler(stages, microbatches, stage_to_rank, costs, memory_limit, policy)
    ls.run()
    if any(ls.remaining):
        stuck = [r for r in range(ls.ranks) if ls.remaining[r]]
        raise MemoryTooSmall(
            f"{name}: the memory limit {[ls.limit[r] for r in stuck]} on ranks {stuck} leaves no room to make "
            "progress; raise memory_limit (at least one microbatch's activations of every stage on a rank, "
            "and max(mem_b, mem_w) per stage: an I adds mem_w - mem_b when mem_w > mem_b)"
        )
    # The list scheduler's own timing; re-timing the order as soon as possible can only end sooner.
    estimate = {
        "estimate_span": max(ls.free_at[r] - ls.first_start[r] for r in range(ls.ranks)),
        "estimate_makespan": max(ls.free_at),
    }
    return Schedule(name, stages, microbatches, tuple(stage_to_rank), tuple(tuple(row) for row in ls.rows), estimate)
