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

When ``mem_w > mem_f`` an I adds ``mem_w - mem_f``; an I that does not fit waits while W passes
free memory (a W of an earlier microbatch is then always pending, see below), and an F is admitted
only with room for that increase: level + mem_f + max(0, mem_w - mem_f) <= limit. On a
single-chunk stage this never deadlocks: let L0 be the level before the last F, admitted with
L0 + mem_f + e <= limit (e = max(0, mem_w - mem_f)), and q0 the W pending then. Since then a I and
b W ran; if no W is pending now, b = a + q0 and the level is
L0 + mem_f + a (mem_w - mem_f) - b mem_w = L0 + mem_f - a mem_f - q0 mem_w <= L0 + mem_f, so the I
fits. So an I that does not fit always finds a pending W of an earlier microbatch, and the only
infeasible limits are those below max(mem_f, mem_w) (``heuristic.minimum_memory``), rejected
before scheduling. Ranks holding several stages (V) keep a reserve for the deeper stages; if they
still get stuck, ``MemoryTooSmall`` says so and the caller tries other candidates.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .costs import StageCosts, memory_ceiling, warmup_windows
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
POLICIES = QUICK_POLICIES + tuple(GreedyPolicy("eager", w, extra) for extra in (None, 0, 1) for w in ("fill", "fit")) + (
    GreedyPolicy("fit", "fill", None),
)


def warmup_counts(stages: int, stage_to_rank: Sequence[int], costs: StageCosts) -> list[int]:
    """Per stage, how many F fit between its first F and the return of microbatch 0's gradient
    (``costs.warmup_windows``), rounded up, at least 1."""
    return [
        max(1, math.ceil(window / costs.f[s] - _EPS)) if costs.f[s] > 0 else 1
        for s, window in enumerate(warmup_windows(stage_to_rank, costs))
    ]


class MemoryTooSmall(ValueError):
    pass


def list_schedule(
    name: str,
    stages: int,
    microbatches: int,
    stage_to_rank: Sequence[int],
    costs: StageCosts,
    memory_limit: Sequence[float] | None,
    policy: GreedyPolicy = GreedyPolicy(),
) -> Schedule:
    """Build per-rank programs (F, I, W) with ``policy``; raises MemoryTooSmall when stuck."""
    S, M = stages, microbatches
    ranks = 1 + max(stage_to_rank)
    stages_of = [[s for s in range(S) if stage_to_rank[s] == r] for r in range(ranks)]
    # F of deeper stages and I of deeper stages first (they are further along their chains).
    for group in stages_of:
        group.sort(reverse=True)
    limit = list(memory_limit) if memory_limit is not None else [math.inf] * ranks
    ceiling = [memory_ceiling(l) for l in limit]
    f_end = [[math.inf] * M for _ in range(S)]
    i_end = [[math.inf] * M for _ in range(S)]
    nf, ni, nw = [0] * S, [0] * S, [0] * S
    free_at = [0.0] * ranks
    first_start = [math.inf] * ranks
    mem = [0.0] * ranks
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    remaining = [3 * M * len(g) for g in stages_of]
    if policy.inflight_extra is None:
        inflight_cap = [M] * S
    else:
        inflight_cap = [c + policy.inflight_extra for c in warmup_counts(S, stage_to_rank, costs)]
    # Memory kept free on a rank for one F (and its I's increase) of each deeper stage it holds (V
    # shapes), so that the oldest microbatch can always continue down the pipeline and back, and
    # for the increase of this stage's own I (mem_w > mem_f).
    reserve = [
        costs.excess(s) + sum(max(costs.mem_f[d], costs.mem_w[d]) for d in stages_of[stage_to_rank[s]] if d > s)
        for s in range(S)
    ]

    def delay(a: int, b: int) -> float:
        return costs.comm if stage_to_rank[a] != stage_to_rank[b] else 0.0

    def f_avail(s: int) -> float:
        k = nf[s]
        return 0.0 if s == 0 else f_end[s - 1][k] + delay(s - 1, s)

    def i_avail(s: int) -> float:
        k = ni[s]
        if k >= nf[s]:
            return math.inf
        if s == S - 1:
            return f_end[s][k]
        return max(f_end[s][k], i_end[s + 1][k] + delay(s + 1, s))

    events: list[tuple[float, int]] = [(0.0, r) for r in range(ranks)]
    heapq.heapify(events)

    def place(r: int, s: int, kind: str, now: float) -> None:
        if kind == "F":
            k = nf[s]
            nf[s] += 1
            end = now + costs.f[s]
            f_end[s][k] = end
            if s + 1 < S:
                heapq.heappush(events, (end + delay(s, s + 1), stage_to_rank[s + 1]))
        elif kind == "I":
            k = ni[s]
            ni[s] += 1
            end = now + costs.b[s]
            i_end[s][k] = end
            if s > 0:
                heapq.heappush(events, (end + delay(s, s - 1), stage_to_rank[s - 1]))
        else:
            k = nw[s]
            nw[s] += 1
            end = now + costs.w[s]
        rows[r].append(Action(s, kind, k))
        first_start[r] = min(first_start[r], now)
        mem[r] += costs.memory_delta(s, kind)
        free_at[r] = end
        remaining[r] -= 1
        heapq.heappush(events, (end, r))

    def decide(r: int, now: float) -> tuple[int, str] | None:
        group = stages_of[r]
        # 1. a returned gradient: I of the oldest microbatch, deeper stage first on ties; when its
        #    increase (mem_w > mem_f) does not fit, a pending W frees memory first
        best = None
        for s in group:
            if ni[s] < M and i_avail(s) <= now + _EPS:
                key = (ni[s], -s)
                if best is None or key < best[0]:
                    best = (key, s)
        if best is not None:
            s = best[1]
            if mem[r] + costs.memory_delta(s, "I") <= ceiling[r]:
                return s, "I"
            pending_w = [t for t in group if nw[t] < ni[t]]
            if pending_w:  # the stage whose W frees the most
                return max(pending_w, key=lambda t: (costs.mem_w[t], -t)), "W"
            return None  # cannot happen on a single-chunk stage (see the module docstring)
        next_i = min((i_avail(s) for s in group if ni[s] < M), default=math.inf)
        ready_f = [s for s in group if nf[s] < M and f_avail(s) <= now + _EPS]
        ready_f = [s for s in ready_f if nf[s] - ni[s] < inflight_cap[s]]
        fits = [s for s in ready_f if mem[r] + costs.mem_f[s] + reserve[s] <= ceiling[r]]
        # 2. a forward that fits in memory
        for s in fits:
            if policy.f_gate == "eager" or now + costs.f[s] <= next_i + _EPS:
                return s, "F"
        w_stage = next((s for s in sorted(group) if nw[s] < ni[s]), None)
        if w_stage is None:
            return None
        # 3. W to make room for a waiting forward
        if ready_f and not fits:
            return w_stage, "W"
        # 4. W to fill the gap
        if policy.w_gate == "fill":
            return w_stage, "W"
        next_f = min(
            (
                f_avail(s)
                for s in group
                if nf[s] < M and nf[s] - ni[s] < inflight_cap[s] and mem[r] + costs.mem_f[s] + reserve[s] <= ceiling[r]
            ),
            default=math.inf,
        )
        upcoming = min(next_i, next_f)
        if fits or now + costs.w[w_stage] <= upcoming + _EPS or upcoming == math.inf:
            return w_stage, "W"
        return None

    while events:
        now, r = heapq.heappop(events)
        if remaining[r] == 0 or free_at[r] > now + _EPS:
            continue
        choice = decide(r, now)
        if choice is not None:
            place(r, choice[0], choice[1], now)
    if any(remaining):
        stuck = [r for r in range(ranks) if remaining[r]]
        raise MemoryTooSmall(
            f"{name}: the memory limit {[limit[r] for r in stuck]} on ranks {stuck} leaves no room to make "
            "progress; raise memory_limit (at least one microbatch's activations of every stage on a rank, "
            "and max(mem_f, mem_w) per stage: an I adds mem_w - mem_f when mem_w > mem_f)"
        )
    # The list scheduler's own timing; re-timing the order as soon as possible can only end sooner.
    estimate = {
        "estimate_span": max(free_at[r] - first_start[r] for r in range(ranks)),
        "estimate_makespan": max(free_at),
    }
    return Schedule(name, S, M, tuple(stage_to_rank), tuple(tuple(row) for row in rows), estimate)
