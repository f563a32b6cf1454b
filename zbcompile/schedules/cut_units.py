"""A model as the cut decision sees it (`cut_choice.py`): a sequence of positions, each with its
time on every rank and its memory, the bytes a boundary crosses at each position, the positions
where a stage may begin and the parameters each position reads. Pure Python: the compiler fills
it from its graphs (`passes/cut_profile.py`), the runtime from measured times.

`Segments` groups the positions between consecutive candidate cut positions, so that the search
(`cut_search.py`) walks a few hundred segments rather than every node of a large model.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Sequence

V_CHUNKS_PER_RANK = 2
# a cut position is a candidate where it crosses at most this share more bytes than the cheapest
# allowed position within CHEAP_WINDOW of the model's time around it
CHEAP_SLACK = 0.25
CHEAP_WINDOW = 0.05

RankTimes = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]  # F, I, W per position


@dataclass(frozen=True)
class CutUnits:
    """The model cut into `positions` (the compiler's anchored forward nodes, in trace order).

    `times[r]`: (F, I, W) seconds of each position on rank r (any one time unit for all);
    `mem_b`, `mem_w`: bytes each position's F keeps for the backward and its W still needs after
    I, per microbatch; `crossing[i]` (i in 0..positions): bytes a boundary just before position
    i sends; `allowed`: positions where a stage may begin (sorted, in 1..positions-1);
    `params`: per parameter (or buffer), its bytes and the positions that read it (a stage holds
    every parameter one of its positions reads). `preferred`: positions always kept as
    candidates (the compiler's own cut, say). `transient`: bytes per position that a stage's
    largest action holds beyond its microbatch's M_B or M_W while it runs (summed over the
    stage's positions; empty: none)."""

    times: tuple[RankTimes, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    crossing: tuple[float, ...]
    allowed: tuple[int, ...]
    params: tuple[tuple[float, tuple[int, ...]], ...] = ()
    preferred: tuple[int, ...] = ()
    transient: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.mem_b)
        if len(self.mem_w) != n or len(self.crossing) != n + 1:
            raise ValueError(f"CutUnits: {n} positions need mem_w of {n} and crossing of {n + 1} values")
        for r, kinds in enumerate(self.times):
            if any(len(values) != n for values in kinds):
                raise ValueError(f"CutUnits: rank {r}'s times are not {n} values per kind")
        if any(not 0 < a < n for a in self.allowed) or list(self.allowed) != sorted(set(self.allowed)):
            raise ValueError(f"CutUnits: allowed positions must be increasing, within 1..{n - 1}")

    @property
    def positions(self) -> int:
        return len(self.mem_b)

    @property
    def ranks(self) -> int:
        return len(self.times)


def _prefix(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


@dataclass
class Segments:
    """`units` between consecutive candidate positions (`bounds`: 0, the candidates, the end):
    segment j is positions [bounds[j], bounds[j + 1]). Sums over any run of positions come from
    prefix sums; `param_ids[j]` are the parameters segment j reads."""

    units: CutUnits
    bounds: list[int]
    _time: list[list[list[float]]] = field(default_factory=list)  # rank -> kind -> prefix
    _mem: list[list[float]] = field(default_factory=list)  # mem_b, mem_w prefixes
    param_ids: list[frozenset[int]] = field(default_factory=list)
    _params: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        u = self.units
        self._time = [[_prefix(kind) for kind in kinds] for kinds in u.times]
        self._mem = [_prefix(u.mem_b), _prefix(u.mem_w), _prefix(u.transient or [0.0] * u.positions)]
        readers: list[set[int]] = [set() for _ in range(len(self.bounds) - 1)]
        for index, (_, positions) in enumerate(u.params):
            for position in positions:
                readers[bisect.bisect_right(self.bounds, position) - 1].add(index)
        self.param_ids = [frozenset(r) for r in readers]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def time(self, rank: int, start: int, end: int, kind: int | None = None) -> float:
        """Seconds of positions [start, end) on `rank`: one kind (0 F, 1 I, 2 W) or all three."""
        kinds = range(3) if kind is None else (kind,)
        return sum(self._time[rank][k][end] - self._time[rank][k][start] for k in kinds)

    def memory(self, start: int, end: int) -> tuple[float, float, float]:
        """(M_B, M_W, transient) bytes of positions [start, end)."""
        return tuple(m[end] - m[start] for m in self._mem)

    def param_bytes(self, ids: set[int] | frozenset[int]) -> float:
        return sum(self.units.params[i][0] for i in ids)

    def params_of(self, start: int, end: int) -> frozenset[int]:
        """Parameters read by positions [start, end) (remembered per range; from the segments'
        `param_ids` where both ends are segment bounds)."""
        key = (start, end)
        if key not in self._params:
            lo, hi = bisect.bisect_left(self.bounds, start), bisect.bisect_left(self.bounds, end)
            if lo < len(self.bounds) and hi < len(self.bounds) and self.bounds[lo] == start and self.bounds[hi] == end:
                read = sorted(frozenset().union(*self.param_ids[lo:hi]))
            else:
                read = [i for i, (_, positions) in enumerate(self.units.params) if _reads(positions, start, end)]
            self._params[key] = frozenset(read)  # built in index order, as every caller's sums expect
        return self._params[key]


def _reads(positions: tuple[int, ...], start: int, end: int) -> bool:
    k = bisect.bisect_left(positions, start)
    return k < len(positions) and positions[k] < end


def candidate_positions(units: CutUnits) -> list[int]:
    """Allowed positions worth cutting at: each crosses at most `CHEAP_SLACK` more bytes than the
    cheapest allowed position within `CHEAP_WINDOW` of the model's time (rank 0's) around it; and
    the `preferred` ones."""
    times = _prefix([f + i + w for f, i, w in zip(*units.times[0])])
    total = times[-1] or 1.0
    allowed = list(units.allowed)
    window = CHEAP_WINDOW * total
    kept = set(units.preferred) & set(allowed)
    lo = hi = 0
    window_min: collections.deque[int] = collections.deque([0])  # indices into allowed, crossing increasing
    for a in allowed:
        while times[allowed[lo]] < times[a] - window:
            lo += 1
        while hi + 1 < len(allowed) and times[allowed[hi + 1]] <= times[a] + window:
            hi += 1
            while window_min and units.crossing[allowed[window_min[-1]]] >= units.crossing[allowed[hi]]:
                window_min.pop()
            window_min.append(hi)
        while window_min[0] < lo:
            window_min.popleft()
        cheapest = units.crossing[allowed[window_min[0]]]  # the least crossing of allowed[lo : hi + 1]
        if units.crossing[a] <= (1 + CHEAP_SLACK) * cheapest:
            kept.add(a)
    return sorted(kept)


def segments_of(units: CutUnits) -> Segments:
    return Segments(units, [0, *candidate_positions(units), units.positions])


def v_rank(chunk: int, ranks: int) -> int:
    """The rank of chunk `chunk` in a V of 2 x `ranks` chunks: down the ranks, then back up."""
    return chunk if chunk < ranks else V_CHUNKS_PER_RANK * ranks - 1 - chunk
