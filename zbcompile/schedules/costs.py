"""Per-stage costs and the memory model.

Times (``f``, ``i``, ``w``, ``comm``) are in any one unit (ms in the paper), named by the schedule's
action letters: ``f`` the forward F, ``i`` the input-gradient backward I (the paper's T_B), ``w``
the weight-gradient backward W; a fused backward B costs ``i + w``, or ``b`` where given (measured:
one action instead of two can take less). Memory follows the paper: F adds
``mem_b`` (M_B), I frees ``mem_b - mem_w``, W frees ``mem_w`` (M_W), a fused B frees ``mem_b``.
Every field is a scalar or one value per stage; for multi-chunk schedules a "stage" is a chunk.

``reduce`` is the time of a stage's gradient reduction over data-parallel replicas (0 without
replicas). It starts once the stage's last W (or fused B) has ended and the rank's link has
finished the reductions posted before it; it occupies that link, not the rank's compute, and the
rank's step ends when both its actions and its reductions have (``simulate``).

``mem_w`` may exceed ``mem_b``. On real stages it often does: I frees what only it needed
(attention scores, MLP pre-activations) but allocates the output gradients every weight gradient
needs, so W's inputs can outweigh F's saved activations. Then I *adds* ``mem_w - mem_b`` and a
rank's peak can occur right after an I. A fused B is I then W in one action: it rises by
``max(0, mem_w - mem_b)`` above the level before it (``memory_rise``) and ends ``mem_b`` lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar, Union

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

# Memory levels are float sums of deltas: a level may pass its limit by rounding, never by more than
# this fraction of the limit (of 1 for limits below 1).
MEMORY_TOLERANCE = 1e-9


def memory_ceiling(limit: float) -> float:
    """The highest memory level that fits ``limit`` (``MEMORY_TOLERANCE`` included)."""
    return limit + MEMORY_TOLERANCE * max(1.0, abs(limit))


def fits_memory(level: float, limit: float) -> bool:
    """Whether memory ``level`` fits ``limit``: the one test every schedule builder and the
    validator use."""
    return level <= memory_ceiling(limit)


def _per_stage(name: str, value: PerStage, stages: int) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        values = (float(value),) * stages
    else:
        values = tuple(float(v) for v in value)
        if len(values) != stages:
            raise ValueError(
                f"cost {name!r} has {len(values)} values but the schedule has {stages} stages; "
                "give one value per stage (chunk) or a scalar"
            )
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"cost {name!r} must be finite and non-negative, got {v}")
    return values


@dataclass(frozen=True)
class ResolvedCosts:
    """Costs resolved to one value per stage (see ``Costs``)."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    reduce: tuple[float, ...] = ()  # () or zeros: no reduction
    b: tuple[float, ...] = ()  # () : a fused B takes i + w

    @property
    def stages(self) -> int:
        return len(self.f)

    def fused(self, stage: int) -> float:
        """Time of `stage`'s fused backward B: ``b`` where given, else I + W."""
        return self.b[stage] if self.b else self.i[stage] + self.w[stage]

    @property
    def reduces(self) -> bool:
        """Whether any stage's gradient reduction takes time."""
        return any(self.reduce)

    def reduction(self, stage: int) -> float:
        """Time of `stage`'s gradient reduction (0 without replicas)."""
        return self.reduce[stage] if self.reduce else 0.0

    def duration(self, stage: int, kind: str) -> float:
        """Compute time of one action; communication actions take no compute time."""
        if kind == "F":
            return self.f[stage]
        if kind == "I":
            return self.i[stage]
        if kind == "W":
            return self.w[stage]
        if kind == "B":
            return self.fused(stage)
        return 0.0

    def memory_delta(self, stage: int, kind: str) -> float:
        """Change of activation memory when the action runs."""
        if kind == "F":
            return self.mem_b[stage]
        if kind == "I":
            return -(self.mem_b[stage] - self.mem_w[stage])
        if kind == "W":
            return -self.mem_w[stage]
        if kind == "B":
            return -self.mem_b[stage]
        return 0.0

    def memory_rise(self, stage: int, kind: str) -> float:
        """Highest memory during the action above the level before it (never below the change at
        its end): a fused B runs its I part first, so it peaks ``max(0, mem_w - mem_b)`` above."""
        if kind == "B":
            return max(0.0, self.mem_w[stage] - self.mem_b[stage])
        return self.memory_delta(stage, kind)

    def excess(self, stage: int) -> float:
        """What an I adds: ``max(0, mem_w - mem_b)`` (0 when W's inputs are part of F's activations)."""
        return max(0.0, self.mem_w[stage] - self.mem_b[stage])

    def work(self, stage: int) -> float:
        """Busy time of one microbatch on a stage: F + I + W."""
        return self.f[stage] + self.i[stage] + self.w[stage]

    def _mapped(self, per_stage: Callable[[tuple[float, ...]], tuple[float, ...]]) -> "ResolvedCosts":
        """Every per-stage field through ``per_stage``; ``comm`` stays."""
        fields = (self.f, self.i, self.w, self.mem_b, self.mem_w, self.reduce, self.b)
        f, i, w, mem_b, mem_w, reduce, b = (per_stage(values) for values in fields)
        return ResolvedCosts(f, i, w, self.comm, mem_b, mem_w, reduce, b)

    def chunked(self, chunks: int) -> "ResolvedCosts":
        """The same model cut into ``chunks`` times as many stages: each stage becomes ``chunks``
        consecutive chunks of equal share (times and memory divided by ``chunks``); ``comm`` stays."""
        return self._mapped(lambda values: tuple(v / chunks for v in values for _ in range(chunks)))

    def merged(self, chunks: int) -> "ResolvedCosts":
        """The inverse cut: every ``chunks`` consecutive chunks summed into one stage (times and
        memory add); ``comm`` stays."""
        if self.stages % chunks:
            raise ValueError(f"cannot merge {self.stages} chunks in groups of {chunks}")
        return self._mapped(lambda values: tuple(sum(values[s : s + chunks]) for s in range(0, len(values), chunks)))


@dataclass(frozen=True)
class Costs:
    """Costs of F/I/W per stage, communication delay and the memory of one microbatch.

    Defaults are uniform unit costs with no communication, ``mem_b=1`` and ``mem_w=0.5``, no
    gradient reduction (``reduce=0``: one replica), and a fused B taking I + W (``b=None``).
    ``mem_w`` may exceed ``mem_b``: an I then adds ``mem_w - mem_b`` (see the module docstring).
    """

    f: PerStage = 1.0
    i: PerStage = 1.0
    w: PerStage = 1.0
    comm: Number = 0.0
    mem_b: PerStage = 1.0
    mem_w: PerStage = 0.5
    reduce: PerStage = 0.0
    b: PerStage | None = None  # a fused backward B's time; None: i + w

    def resolve(self, stages: int) -> ResolvedCosts:
        """One value per stage; raises ValueError on a length mismatch or a negative value."""
        if not isinstance(self.comm, (int, float)) or not math.isfinite(self.comm) or self.comm < 0:
            raise ValueError(f"comm must be a finite non-negative number, got {self.comm!r}")
        mem_b = _per_stage("mem_b", self.mem_b, stages)
        mem_w = _per_stage("mem_w", self.mem_w, stages)
        return ResolvedCosts(
            f=_per_stage("f", self.f, stages),
            i=_per_stage("i", self.i, stages),
            w=_per_stage("w", self.w, stages),
            comm=float(self.comm),
            mem_b=mem_b,
            mem_w=mem_w,
            reduce=_per_stage("reduce", self.reduce, stages),
            b=() if self.b is None else _per_stage("b", self.b, stages),
        )


def warmup_windows(stage_to_rank: Sequence[int], costs: ResolvedCosts) -> list[float]:
    """Per stage, the time from its first F's start until microbatch 0's gradient is back from the
    last stage (F then I back to back down and up the pipeline, a cross-rank input delayed by
    ``comm``): the window a stage fills with warm-up forwards."""
    stages = len(stage_to_rank)

    def delay(a: int, b: int) -> float:
        return costs.comm if stage_to_rank[a] != stage_to_rank[b] else 0.0

    first_f = [0.0] * stages
    for s in range(1, stages):
        first_f[s] = first_f[s - 1] + costs.f[s - 1] + delay(s - 1, s)
    grad_back = [0.0] * stages
    grad_back[-1] = first_f[-1] + costs.f[-1]
    for s in range(stages - 2, -1, -1):
        grad_back[s] = grad_back[s + 1] + costs.i[s + 1] + delay(s + 1, s)
    return [back - first for first, back in zip(first_f, grad_back)]


CostsLike = TypeVar("CostsLike", Costs, ResolvedCosts)


def with_reduction(costs: CostsLike, per_comm: Sequence[float]) -> CostsLike:
    """``costs`` with each stage's reduction time ``per_comm[s] x costs.comm``: a reduction that
    moves ``per_comm[s]`` times the bytes of the message ``comm`` times, over the same link. Costs
    that already give a reduction time keep it."""
    given = costs.reduce if isinstance(costs.reduce, (int, float)) else any(costs.reduce)
    if given or not any(per_comm) or not costs.comm:
        return costs
    return replace(costs, reduce=tuple(float(costs.comm) * r for r in per_comm))


def resolve_costs(costs: Costs | ResolvedCosts | None, stages: int) -> ResolvedCosts:
    """Accept ``None`` (defaults), ``Costs`` or already resolved ``ResolvedCosts``."""
    if costs is None:
        costs = Costs()
    if isinstance(costs, ResolvedCosts):
        if costs.stages != stages:
            raise ValueError(f"costs are resolved for {costs.stages} stages, the schedule has {stages}")
        return costs
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a zbcompile.schedules.Costs, got {type(costs).__name__}")
    return costs.resolve(stages)


@dataclass(frozen=True)
class EmulatedTimes:
    """Every action's time where a pipeline emulates them (`runtime/step/action_pace.py`): `costs` (per
    stage, or per chunk for a multi-chunk schedule; a fused B takes I + W) times `unit_s` seconds
    per unit (1e-3 for costs in ms, as the paper's); a message between ranks takes at least
    `costs.comm` units, a stage's gradient reduction `costs.reduce` units."""

    costs: ResolvedCosts
    unit_s: float = 1e-3

    @classmethod
    def of(cls, costs: Costs | ResolvedCosts, stages: int, unit_s: float = 1e-3) -> "EmulatedTimes":
        """`costs` resolved to `stages` stages (chunks)."""
        if not unit_s > 0:
            raise ValueError(f"emulated times: unit_s must be positive seconds per cost unit, got {unit_s!r}")
        return cls(resolve_costs(costs, stages), float(unit_s))

    @property
    def stages(self) -> int:
        return self.costs.stages

    @property
    def link_s(self) -> float:
        return self.costs.comm * self.unit_s

    def seconds(self, stage: int, kind: str) -> float:
        return self.costs.duration(stage, kind) * self.unit_s

    def reduce_s(self, stage: int) -> float:
        """Seconds of `stage`'s gradient reduction over the replicas (0 without)."""
        return self.costs.reduction(stage) * self.unit_s
