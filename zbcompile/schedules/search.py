"""zb-auto's search step: a parametric schedule family, coordinate descent, gap filling, local search.

Why this family. With the span objective, stage s's own window starts when the first forward
reaches it, s (T_F + comm) after stage 0's. The gradient of the last microbatch leaves stage s and
still needs s (T_B + comm) to reach stage 0, which must then run its last I and W. For every stage
to end its window on time, stage s keeps about ``s (T_F + T_B + 2 comm) / T_W + 1`` weight passes
(W) for its tail, and warms up with as many forwards as fit before the first gradient returns.
``pattern_rows`` builds, per stage,

    F x warm[s]; then (I, W while more than defer[s] are pending or memory demands, F) ...; W tail

(``w_after`` puts the W after the F instead). ZB-H1 and ZB-H2 are members of this family. The
search runs four phases (methods of ``_Search``): ``grid`` around the analytic warm-up and
deferral counts, ``descend`` (coordinate descent per stage from the best member),
``fill_idle_gaps`` (pending W into every rank's gaps) and ``move_single_w`` (local search on the
critical ranks). Every candidate is re-timed by ``fastsim.Evaluator`` (the simulator's rule) and must fit
the memory limit. The search stops at a deadline (seconds) or, with ``deterministic=True``, after a
fixed amount of work derived from the budget, so that results do not depend on machine load.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

from .costs import ResolvedCosts, fits_memory, memory_ceiling, warmup_windows
from .fastsim import Evaluator
from .handcrafted import in_line, zb_h2
from .row_edits import fill_gaps, move_one_w

_EPS = 1e-9
# Work-based limit for deterministic runs: evaluations of ``n`` actions cost about this many seconds
# per action (a conservative figure for CPython on one core).
SECONDS_PER_ACTION = 2.5e-6


@dataclass
class SearchResult:
    rows: list[list[int]] | None
    score: tuple[float, float]
    info: dict


class _Clock:
    """Deadline in wall seconds, or a fixed number of evaluations when deterministic."""

    def __init__(self, budget: float, actions: int, deterministic: bool):
        self.deterministic = deterministic
        self.started = time.perf_counter()
        self.budget = budget
        self.deadline = self.started + budget
        self.max_evals = max(1, int(budget / (max(actions, 1) * SECONDS_PER_ACTION)))
        self.evals = 0
        self.eval_time = 0.0  # the longest evaluation so far (wall seconds)

    def tick(self) -> None:
        self.evals += 1

    def timed(self, fn, *args):
        """Run one evaluation-sized step and remember how long such a step takes."""
        started = time.perf_counter()
        result = fn(*args)
        self.eval_time = max(self.eval_time, time.perf_counter() - started)
        return result

    def spent(self, fraction: float) -> bool:
        """Has ``fraction`` of the budget been used?"""
        if self.deterministic:
            return self.evals >= fraction * self.max_evals
        return time.perf_counter() >= self.started + fraction * self.budget

    def out(self) -> bool:
        if self.deterministic:
            return self.evals >= self.max_evals
        # stop early enough that one more step (evaluation plus bookkeeping) still ends in time
        return time.perf_counter() + 3 * self.eval_time >= self.deadline


def pattern_rows(
    ev: Evaluator, limits: Sequence[float], warm: Sequence[int], defer: Sequence[int], w_after: bool = False,
    drain: int = 0, floor: Sequence[int] | None = None,
) -> list[list[int]] | None:
    """Per-stage programs of the family above (single chunk: stage s on rank s), None if stuck."""
    S, M = ev.S, ev.M
    mem = ev.mem
    rows = []
    for s in range(S):
        lim = memory_ceiling(limits[s])
        F, I, W = ev.id(s, 0, 0), ev.id(s, 1, 0), ev.id(s, 2, 0)  # ids of microbatch k: base + k
        mf, mi, mw = mem[F], mem[I], mem[W]
        # An F is admitted only with room for the increase of an I right after it (mem_w > mem_b:
        # mi > 0); then an I never lacks memory once the pending W have run (see greedy.py).
        mfe = mf + max(0.0, mi)
        row: list[int] = []
        nf = ni = nw = 0
        level = 0.0
        d = defer[s]
        while nf < min(warm[s], M) and level + mfe <= lim:
            row.append(F + nf)
            nf += 1
            level += mf
        if nf == 0:
            return None
        while ni < M:
            if ni >= nf:  # nothing in flight: the next forward first
                while level + mfe > lim and nw < ni:
                    row.append(W + nw); nw += 1; level += mw
                if level + mfe > lim:
                    return None
                row.append(F + nf); nf += 1; level += mf
            while level + mi > lim and nw < ni:  # an I that raises memory waits for W
                row.append(W + nw); nw += 1; level += mw
            if level + mi > lim:
                return None
            row.append(I + ni); ni += 1; level += mi
            if nf >= M and drain:  # drain: W fills the slot a forward would have taken
                extra = 0
                while extra < drain and nw < ni and ni - nw > floor[s] - (M - ni):
                    row.append(W + nw); nw += 1; level += mw; extra += 1
            if not w_after:
                while nw < ni and (ni - nw > d or (nf < M and level + mfe > lim)):
                    row.append(W + nw); nw += 1; level += mw
            if nf < M:
                while level + mfe > lim and nw < ni:
                    row.append(W + nw); nw += 1; level += mw
                if level + mfe > lim:
                    return None
                row.append(F + nf); nf += 1; level += mf
            if w_after:
                while nw < ni and ni - nw > d:
                    row.append(W + nw); nw += 1; level += mw
        while nw < M:
            row.append(W + nw); nw += 1
        rows.append(row)
    return rows


def handcrafted_rows(ev: Evaluator, name: str) -> list[list[int]]:
    """1F1B (B split into I then W), ZB-H1 or ZB-H2 (``handcrafted.py``) as evaluator rows."""
    S, M = ev.S, ev.M
    if name in ("1f1b", "zb-h1"):  # both are members of the family: warm-up p - s, W lag 0 or s
        unlimited = [math.inf] * S
        return pattern_rows(ev, unlimited, [S - s for s in range(S)], [0 if name == "1f1b" else s for s in range(S)])
    if name != "zb-h2":
        raise ValueError(f"no handcrafted rows for {name!r}")
    return ev.rows_of(zb_h2(S, M))


def analytic_parameters(
    S: int, costs: ResolvedCosts, alpha: float = 1.0, beta: int = 0, shift: int = 0, round_at: float = 0.85
):
    """Warm-up and deferral counts of the family.

    Warm-up: the forwards that fit between stage s's first F and the return of the first gradient,
    q = window / T_F, rounded up only when its fraction exceeds ``round_at`` (one more F delays that
    gradient for every upstream stage, one fewer leaves a gap of the fraction), plus ``shift``.
    Deferral: alpha * s (T_F + T_B + 2 comm) / T_W + beta (see the module docstring)."""
    warm = []
    for s, window in enumerate(warmup_windows(in_line(S), costs)):
        q = window / costs.f[s] if costs.f[s] > 0 else 1.0
        whole = math.floor(q + _EPS)
        warm.append(max(1, whole + (1 if q - whole > round_at + _EPS else 0) + shift))
    defer = []
    for s in range(S):
        chain = sum(costs.f[t] + costs.i[t] + 2 * costs.comm for t in range(1, s + 1))
        w = max(costs.w[s], _EPS)
        defer.append(max(0, math.ceil(alpha * chain / w - _EPS) + beta))
    return warm, defer


class _Member(NamedTuple):
    """One member of the family: ``pattern_rows``' parameters after ``ev`` and ``limits``."""

    warm: Sequence[int]
    defer: Sequence[int]
    w_after: bool = False
    drain: int = 0
    floor: Sequence[int] | None = None


# (round_at, shift, alpha, beta, w_after) around the analytic parameters, most promising first;
# alpha = inf never defers a W past the tail
_GRID = sorted(
    [
        (round_at, shift, alpha, beta, w_after)
        for w_after in (False, True)
        for round_at in (0.85, 0.0, 0.5)
        for shift in (0, -1, 1)
        for alpha, beta in ((1.0, 0), (1.0, 1), (1.25, 0), (0.75, 0), (1.5, 1), (0.5, 0), (math.inf, 0))
    ],
    key=lambda g: (g[4], g[1] != 0, g[0] != 0.85, g[2] != 1.0, g[3], g[2]),
)
# coordinate descent steps: ("d" deferral | "w" warm-up, change)
_DESCENT_STEPS = (("d", 1), ("d", -1), ("w", 1), ("w", -1), ("d", 3), ("d", -3))


class _Search:
    """The best rows found so far and the best member of the family; the phases below offer
    candidates to it, each stopping when the clock runs out."""

    def __init__(self, ev: Evaluator, limits: Sequence[float], objective: str, clock: _Clock):
        self.ev, self.lims, self.objective, self.clock = ev, limits, objective, clock
        self.best_rows: list[list[int]] | None = None
        self.best = (math.inf, math.inf)
        self.member: _Member | None = None  # the best member of the family, and its score
        self.member_score = (math.inf, math.inf)

    def score(self, rows) -> tuple[float, float]:
        self.clock.tick()
        return self.clock.timed(self.ev.score, rows, self.objective)

    def offer(self, rows) -> tuple[float, float] | None:
        """Score ``rows`` unless missing or over the memory limit (None); keep them if best."""
        if rows is None or not self.ev.fits(rows, self.lims):
            return None
        value = self.score(rows)
        if value < self.best:
            self.best, self.best_rows = value, rows
        return value

    def offer_members(self, members: Iterable[_Member], stop: Callable[[], bool]) -> None:
        for member in members:
            if stop():
                break
            value = self.offer(pattern_rows(self.ev, self.lims, *member))
            if value is not None and value < self.member_score:
                self.member_score, self.member = value, member

    def grid(self, costs: ResolvedCosts) -> None:
        """Phase 1: the grid around the analytic parameters (up to 40% of the budget), then the
        drain variants of its best point."""
        S, M = self.ev.S, self.ev.M

        def members():
            for round_at, shift, alpha, beta, w_after in _GRID:
                if alpha == math.inf:
                    warm, _ = analytic_parameters(S, costs, 1.0, 0, shift, round_at)
                    yield _Member(warm, [M] * S, w_after)
                else:
                    yield _Member(*analytic_parameters(S, costs, alpha, beta, shift, round_at), w_after)

        self.offer_members(members(), lambda: self.clock.spent(0.4))
        if self.member is not None:
            _, floor = analytic_parameters(S, costs, 1.0, 1, 0)
            base = self.member
            self.offer_members((base._replace(drain=d, floor=floor) for d in (1, 2, 3)), self.clock.out)

    def descend(self) -> None:
        """Phase 2: coordinate descent from the best member on each stage's warm-up and deferral
        counts, the ranks with the longest spans first; the first improving step is taken."""
        ev, clock = self.ev, self.clock
        member = self.member
        if member is None:
            return
        improved = True
        while improved and not clock.out():
            improved = False
            for s in clock.timed(_critical_first, ev, pattern_rows(ev, self.lims, *member)):
                for which, delta in _DESCENT_STEPS:
                    if clock.out():
                        break
                    candidate = _nudged(member, s, which, delta)
                    if candidate is None:
                        continue
                    step_started = time.perf_counter()
                    value = self.offer(pattern_rows(ev, self.lims, *candidate))
                    if value is None:
                        continue
                    clock.eval_time = max(clock.eval_time, time.perf_counter() - step_started)
                    if value < self.member_score:
                        self.member_score, member, improved = value, candidate, True
                        break

    def fill_idle_gaps(self) -> None:
        """Phase 3: fill idle gaps of every rank at once with pending W (``fill_gaps``), re-timed
        after each round, for gaps of at least a whole W, then of smaller fractions."""
        ev, clock = self.ev, self.clock
        if self.best_rows is None:
            return
        end = [-1.0] * len(ev.dur)
        for fraction in (1.0, 0.75, 0.5, 0.25):
            if clock.out():
                break
            improved = True
            while improved and not clock.out():
                improved = False
                best_rows = self.best_rows
                if clock.timed(ev.times, best_rows, end) is None:
                    break
                rows = clock.timed(lambda: [fill_gaps(ev, row, end, fraction) for row in best_rows])
                if clock.out():
                    break
                if rows == best_rows or not ev.fits(rows, self.lims):
                    break
                value = self.score(rows)
                if value < self.best:
                    self.best, self.best_rows, improved = value, rows, True

    def move_single_w(self, seed: int) -> None:
        """Phase 4, local search: on a rank with a long span (the longest 60% of the time), move
        one W into an idle gap or a few places (``move_one_w``); keep the move if the score improves.
        Stops after 60 S moves in a row without improvement."""
        ev, clock = self.ev, self.clock
        if self.best_rows is None or clock.out():
            return
        rng = random.Random(seed)
        rows = [list(r) for r in self.best_rows]
        end = [-1.0] * len(ev.dur)
        stale = 0
        while not clock.out() and stale < 60 * ev.S:
            first, last = clock.timed(ev.times, rows, end)
            spans = [y - x for x, y in zip(first, last)]
            order = sorted(range(len(rows)), key=lambda q: -spans[q])
            r = order[0] if rng.random() < 0.6 else order[rng.randrange(min(4, len(order)))]
            row = rows[r]
            saved = list(row)
            if not move_one_w(ev, row, end, rng):
                stale += 1
                continue
            if not fits_memory(ev.peak(row), self.lims[r]):
                rows[r] = saved
                stale += 1
                continue
            value = self.score(rows)
            if value < self.best:
                self.best, stale = value, 0
                self.best_rows = [list(x) for x in rows]
            else:
                rows[r] = saved
                stale += 1


def _nudged(member: _Member, stage: int, which: str, delta: int) -> _Member | None:
    """``member`` with ``stage``'s warm-up ("w", at least 1) or deferral ("d", at least 0) count
    changed by ``delta``; None when that leaves the range."""
    warm, defer = list(member.warm), list(member.defer)
    if which == "w":
        warm[stage] += delta
        if warm[stage] < 1:
            return None
    else:
        defer[stage] += delta
        if defer[stage] < 0:
            return None
    return member._replace(warm=warm, defer=defer)


def search(
    ev: Evaluator, limits: Sequence[float] | None, objective: str, budget: float, deterministic: bool = False,
    start_rows: list[list[int]] | None = None, seed: int = 0,
) -> SearchResult:
    """Best rows found within ``budget`` (see the module docstring); starts from ``start_rows``.
    ``info`` holds the best value after each phase and when it ended."""
    clock = _Clock(budget, 3 * ev.S * ev.M, deterministic)
    run = _Search(ev, list(limits) if limits is not None else [math.inf] * ev.S, objective, clock)
    costs = _costs_of(ev)
    if start_rows is not None:
        run.best, run.best_rows = run.score(start_rows), start_rows
    info = {"search_start": run.best[0]}
    for name, phase in (
        ("grid", lambda: run.grid(costs)),
        ("descent", run.descend),
        ("fill", run.fill_idle_gaps),
        ("local", lambda: run.move_single_w(seed)),
    ):
        phase()
        info[f"search_{name}"] = run.best[0]
        info[f"search_{name}_at_s"] = round(time.perf_counter() - clock.started, 3)
    info["search_evaluations"] = clock.evals
    return SearchResult(run.best_rows, run.best, info)


def _critical_first(ev: Evaluator, rows) -> list[int]:
    """Rank indices, longest span first."""
    timed = ev.times(rows)
    if timed is None:
        return list(range(len(rows)))
    first, last = timed
    spans = [b - a for a, b in zip(first, last)]
    return sorted(range(len(rows)), key=lambda r: -spans[r])


def _costs_of(ev: Evaluator) -> ResolvedCosts:
    S = ev.S
    f = tuple(ev.dur[ev.id(s, 0, 0)] for s in range(S))
    i = tuple(ev.dur[ev.id(s, 1, 0)] for s in range(S))
    w = tuple(ev.dur[ev.id(s, 2, 0)] for s in range(S))
    comm = max((ev.delay[ev.id(s, 0, 0)] for s in range(1, S)), default=0.0)
    mem_b = tuple(ev.mem[ev.id(s, 0, 0)] for s in range(S))
    mem_w = tuple(-ev.mem[ev.id(s, 2, 0)] for s in range(S))
    return ResolvedCosts(f, i, w, comm, mem_b, mem_w, ev.reduce or ())
