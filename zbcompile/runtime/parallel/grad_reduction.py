"""Averaging gradients over data-parallel replicas, overlapped with the rest of the step.

A stage's parameter gradients are final once the step's last action producing them (its last W, or
its last fused B) has run, which a zero-bubble schedule often reaches well before the rank's last
action. `GradReduction` then flattens them into buckets (at most `BUCKET_BYTES`, one dtype each, as
DDP does) and posts an asynchronous all-reduce (data_parallel="replicate") or reduce-scatter
("shard", `runtime/parallel/sharding.py`) of each bucket over the replicas' process group; the rank goes on
with its remaining actions while the buckets travel, and the step waits for them (with a timeout)
only before it returns the gradients.

Collectives over a group must be posted in the same order on all its ranks: stages post in the
order of their last gradient action in the program (`ReductionPlan.order`), the same on every
replica; a stage that finishes early (readiness may run a W early) waits for the stages before
it. Gradients of a parameter that other ranks of the pipeline also hold (tied weights, mirrored
schedules) or that several stages of this rank use are summed first, after the drain, and
reduced then (`reduce_now`). Every bucket is the sum over replicas divided by their number, so
the bits are the same as reducing tensor by tensor wherever the backend's sum of each element
does not depend on the bucket (two replicas: a + b)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zbcompile.runtime.parallel.sharding import ReduceScatterLayout, wait
from zbcompile.schedules import Action
from zbcompile.schedules.simulate import GRAD_KINDS

if TYPE_CHECKING:
    from zbcompile.compiler import CompiledPipeline

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
REDUCE = "REDUCE"  # how timelines name a gradient reduction: "REDUCE <stage>", "REDUCE (after the step)"


@dataclass(frozen=True)
class ReductionPlan:
    """For one rank's program: `expected[s]`, how many W and B actions of stage s a step runs;
    `order`, this rank's stages in the order of their last such action; `overlapped[s]`, the
    parameters whose gradients stage s's last action makes final (each used by s alone here and
    held by no other rank)."""

    expected: Mapping[int, int]
    order: tuple[int, ...]
    overlapped: Mapping[int, frozenset[str]]

    @staticmethod
    def of(
        actions: Sequence[Action], param_fqns: Mapping[int, Sequence[str]], shared: Sequence[str]
    ) -> "ReductionPlan":
        """The plan of `actions` (one rank's program) for stages using `param_fqns` (by stage);
        `shared`: the parameters other ranks of the pipeline also hold."""
        expected: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, action in enumerate(actions):
            if action.kind in GRAD_KINDS:
                expected[action.stage] = expected.get(action.stage, 0) + 1
                last[action.stage] = index
        users: dict[str, list[int]] = {}
        for stage in expected:
            for fqn in param_fqns[stage]:
                users.setdefault(fqn, []).append(stage)
        overlapped = {
            stage: frozenset(f for f in param_fqns[stage] if users[f] == [stage] and f not in shared)
            for stage in expected
        }
        return ReductionPlan(expected, tuple(sorted(last, key=last.__getitem__)), overlapped)

    def ready(self, ran: Mapping[int, int], posted: int) -> list[int]:
        """The stages of `order` from position `posted` on whose gradients are final, given how
        many W and B of each stage have run (`ran`), up to the first that is not: what to post now."""
        found = []
        for stage in self.order[posted:]:
            if ran.get(stage, 0) != self.expected[stage]:
                break
            found.append(stage)
        return found

    def check_posted(self, ran: Mapping[int, int], posted: int) -> None:
        """Raise where a stage's reduction was not posted by the step's end (`posted` of `order`)."""
        if posted < len(self.order):
            stage = self.order[posted]
            rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
            raise RuntimeError(
                f"{rank}stage {stage} ran {ran.get(stage, 0)} of its "
                f"{self.expected[stage]} gradient actions in the step; its gradients were never reduced"
            )


@dataclass
class _Bucket:
    fqns: list[str]
    tensors: list[torch.Tensor]
    flat: torch.Tensor  # what the collective leaves its result in
    work: dist.Work
    label: str
    posted: float
    layout: ReduceScatterLayout | None = None


@dataclass
class GradReduction:
    """One step's reduction over `group` (`size` replicas) following `plan`; `grads_of(stage)`
    gives a stage's accumulated gradients by FQN. With `mesh` (the replicas' "dp" mesh:
    data_parallel="shard") each bucket is reduce-scattered and a gradient becomes this replica's
    DTensor shard of it (`sharding.ReduceScatterLayout`); without, all-reduced. `released(fqns)`
    is called once a stage's overlapped gradients are posted (its parameters are no longer
    read). Call `ran(stage)` after every W and B, and `finish()` once the step's actions have
    run. `timeline` holds ("REDUCE <stage>", posted, waited) per stage, in `time.perf_counter()`
    seconds."""

    plan: ReductionPlan
    group: dist.ProcessGroup
    size: int
    grads_of: Callable[[int], Mapping[str, torch.Tensor]]
    timeout: timedelta
    mesh: DeviceMesh | None = None
    released: Callable[[Sequence[str]], None] = lambda fqns: None
    bucket_bytes: int = BUCKET_BYTES
    timeline: list[tuple[str, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ran: dict[int, int] = {}
        self._next = 0  # position in plan.order of the next stage to post
        self._buckets: list[_Bucket] = []

    def ran(self, stage: int) -> None:
        """A W or B of `stage` ran: post the stages whose gradients are now final, in plan order."""
        self._ran[stage] = self._ran.get(stage, 0) + 1
        for stage in self.plan.ready(self._ran, self._next):
            grads = self.grads_of(stage)
            fqns = [f for f in sorted(self.plan.overlapped[stage]) if f in grads]
            self._post(fqns, grads, f"{REDUCE} {stage}")
            self.released(sorted(self.plan.overlapped[stage]))
            self._next += 1

    def finish(self) -> dict[str, torch.Tensor]:
        """The overlapped gradients averaged over the replicas, by FQN, once their buckets arrived."""
        self.plan.check_posted(self._ran, self._next)
        return self._wait()

    def reduce_now(
        self, fqns: Sequence[str], grads: Mapping[str, torch.Tensor], label: str = REDUCE
    ) -> dict[str, torch.Tensor]:
        """`grads[f]` for `f` in `fqns` averaged over the replicas, posted and waited for now."""
        self._post(list(fqns), grads, label)
        return self._wait()

    def _post(self, fqns: list[str], grads: Mapping[str, torch.Tensor], label: str) -> None:
        for bucket in _buckets(fqns, grads, self.bucket_bytes):
            tensors = [grads[f] for f in bucket]
            posted = time.perf_counter()
            if self.mesh is None:
                layout, flat = None, torch.cat([t.reshape(-1) for t in tensors])
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            else:
                layout = ReduceScatterLayout(tensors, self.group)
                flat = layout.output(tensors[0])
                work = dist.reduce_scatter_single(flat, layout.input(tensors), group=self.group, async_op=True)
            self._buckets.append(_Bucket(bucket, tensors, flat, work, label, posted, layout))

    def _wait(self) -> dict[str, torch.Tensor]:
        reduced: dict[str, torch.Tensor] = {}
        spans: dict[str, tuple[float, float]] = {}
        for bucket in self._buckets:
            wait(bucket.work, self.timeout, f"{bucket.label}: reducing the gradients of {bucket.fqns[:3]}")
            bucket.flat.div_(self.size)
            if bucket.layout is None:
                sizes = [t.numel() for t in bucket.tensors]
                parts = [p.view_as(t) for p, t in zip(bucket.flat.split(sizes), bucket.tensors)]
            else:
                parts = bucket.layout.shards(bucket.flat, self.mesh)
            reduced.update(zip(bucket.fqns, parts))
            posted, _ = spans.get(bucket.label, (bucket.posted, 0.0))
            spans[bucket.label] = (min(posted, bucket.posted), time.perf_counter())
        self.timeline += [(label, start, end) for label, (start, end) in spans.items()]
        self._buckets = []
        return reduced


def reduction_per_message(
    compiled: "CompiledPipeline", replicas: int, mode: str, grad_dtype: torch.dtype | None = None
) -> tuple[float, ...]:
    """Per compiled stage, the bytes a rank moves to average the stage's gradients over
    `replicas` (a ring all-reduce moves 2 (d-1)/d of them, "replicate"; a reduce-scatter (d-1)/d,
    "shard"; in `grad_dtype` where given), in units of the largest boundary message, the one a
    schedule's `comm` times: `schedules.costs.with_reduction` turns them into reduction times.
    Zeros for one replica."""
    largest = max(compiled.partition.boundary_bytes, default=0)
    if replicas < 2 or largest == 0:
        return (0.0,) * len(compiled.partition.stages)
    share = (2 if mode == "replicate" else 1) * (replicas - 1) / replicas
    params = dict(compiled.traced.model.named_parameters())

    def grad_bytes(p: torch.Tensor) -> int:
        itemsize = grad_dtype.itemsize if grad_dtype is not None and p.is_floating_point() else p.element_size()
        return p.numel() * itemsize

    stages = compiled.partition.stages
    return tuple(share * sum(grad_bytes(params[f]) for f in s.param_fqns) / largest for s in stages)


def _buckets(fqns: Sequence[str], grads: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """`fqns` in buckets of one dtype and device, each at most `bucket_bytes` (or one tensor)."""
    buckets: list[list[str]] = []
    open_buckets: dict[tuple, tuple[list[str], int]] = {}
    for fqn in fqns:
        grad = grads[fqn]
        key = (grad.dtype, grad.device)
        nbytes = grad.numel() * grad.element_size()
        bucket, filled = open_buckets.get(key, (None, 0))
        if bucket is None or filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(fqn)
        open_buckets[key] = (bucket, filled + nbytes)
    return buckets
