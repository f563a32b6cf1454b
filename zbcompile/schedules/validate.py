"""The validator: every schedule passes here before anything uses it.

Checks, in order, each with an error (``ScheduleError``, a ValueError) naming rank, action and rule:
1. placement: every action sits on the rank that runs its stage for its microbatch
   (``Schedule.rank_of``); stages and microbatches in range;
2. completeness: per (stage, microbatch) one F and either one fused B or one I and one W;
3. order invariant: on every stage F, I/B and W run in increasing microbatch order (the runtime's
   gradient accumulation relies on it);
4. dependencies: the programs run to completion (no cross-rank cycle, see ``timing.asap_timing``);
5. memory: each rank's peak stays within its limit;
6. communication: after lowering, the programs are free of deadlock under blocking send/recv.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence, Union

from .costs import Costs, ResolvedCosts, fits_memory, resolve_costs
from .ir import Action, Schedule
from .lower import check_rendezvous, lower, message_of
from .simulate import peak_memory, simulate
from .timing import ScheduleError

MemoryLimit = Union[None, float, Sequence[float]]


def rank_limits(limit: MemoryLimit, ranks: int) -> tuple[float, ...] | None:
    """A scalar or one value per rank (= per stage for single-chunk schedules); None is unlimited."""
    if limit is None:
        return None
    if isinstance(limit, (int, float)):
        return (float(limit),) * ranks
    values = tuple(float(v) for v in limit)
    if len(values) != ranks:
        raise ValueError(f"memory_limit has {len(values)} values for {ranks} ranks; give a scalar or one per rank")
    return values


def _check_placement(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if not 0 <= a.stage < schedule.stages:
                raise ScheduleError(f"rank {rank}: {a} names stage {a.stage}, but there are {schedule.stages} stages")
            if not 0 <= a.microbatch < schedule.microbatches:
                raise ScheduleError(
                    f"rank {rank}: {a} names microbatch {a.microbatch}, but there are {schedule.microbatches}"
                )
            if a.is_compute and schedule.rank_of(a.stage, a.microbatch) != rank:
                raise ScheduleError(
                    f"rank {rank}: {a} belongs to stage {a.stage}, which runs microbatch {a.microbatch} on rank "
                    f"{schedule.rank_of(a.stage, a.microbatch)}"
                )


def _check_complete(schedule: Schedule) -> None:
    counts = Counter((a.stage, a.kind, a.microbatch) for row in schedule.actions for a in row if a.is_compute)
    for (stage, kind, mb), n in counts.items():
        if n > 1:
            raise ScheduleError(f"rank {schedule.rank_of(stage, mb)}: {Action(stage, kind, mb)} appears {n} times")
    for stage in range(schedule.stages):
        for mb in range(schedule.microbatches):
            rank = schedule.rank_of(stage, mb)
            has = {kind for kind in "FIWB" if counts.get((stage, kind, mb))}
            if "F" not in has:
                raise ScheduleError(f"rank {rank}: {Action(stage, 'F', mb)} is missing")
            if "B" in has and has & {"I", "W"}:
                raise ScheduleError(
                    f"rank {rank}: microbatch {mb} of stage {stage} has a fused B and a split I/W; use one or the other"
                )
            if "B" not in has and has != {"F", "I", "W"}:
                missing = sorted({"I", "W"} - has)
                raise ScheduleError(
                    f"rank {rank}: {', '.join(str(Action(stage, k, mb)) for k in missing)} missing (needs B, or I and "
                    "W)"
                )


def _check_order(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        last: dict[tuple[int, str], Action] = {}
        seen: set[Action] = set()
        for a in row:
            if not a.is_compute:
                continue
            group = (a.stage, "I" if a.kind == "B" else a.kind)
            prev = last.get(group)
            if prev is not None and prev.microbatch > a.microbatch:
                raise ScheduleError(
                    f"rank {rank}: {a} runs after {prev}; on every stage F, I/B and W must run in increasing "
                    "microbatch order"
                )
            last[group] = a
            needed = {"I": "F", "B": "F", "W": "I"}.get(a.kind)
            if needed and Action(a.stage, needed, a.microbatch) not in seen:
                raise ScheduleError(
                    f"rank {rank}: {a} runs before {Action(a.stage, needed, a.microbatch)} on the same rank"
                )
            seen.add(a)


def _check_messages(schedule: Schedule) -> None:
    """A lowered schedule must carry exactly the messages its cross-rank edges need."""
    compute = [a for row in schedule.actions for a in row if a.is_compute]
    expected = Counter()
    for a in compute:
        message = message_of(a, schedule.stages, schedule.stage_to_rank)
        if message:
            expected.update(message)
    actual = Counter(a for row in schedule.actions for a in row if not a.is_compute)
    if expected != actual:
        extra = sorted(str(a) for a in (actual - expected))
        missing = sorted(str(a) for a in (expected - actual))
        raise ScheduleError(
            f"lowered schedule messages do not match its edges: missing {missing[:5]}, extra {extra[:5]}"
        )
    for rank, row in enumerate(schedule.actions):
        for a in row:
            if a.kind in ("SEND_F", "SEND_B") and schedule.rank_of(a.stage, a.microbatch) != rank:
                raise ScheduleError(f"rank {rank}: {a} sends for stage {a.stage}, which runs on another rank")
            if a.kind in ("RECV_F", "RECV_B") and schedule.rank_of(a.stage, a.microbatch) != rank:
                raise ScheduleError(f"rank {rank}: {a} receives for stage {a.stage}, which runs on another rank")


def validate(
    schedule: Schedule,
    costs: Costs | ResolvedCosts | None = None,
    memory_limit: MemoryLimit = None,
    check_lowering: bool = True,
) -> None:
    """Raise ScheduleError (a ValueError) unless ``schedule`` is runnable; see the module docstring."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate() takes a Schedule, got {type(schedule).__name__}")
    sc = resolve_costs(costs, schedule.stages)
    _check_placement(schedule)
    _check_complete(schedule)
    _check_order(schedule)
    compute = schedule.compute_only()
    simulate(compute, sc)  # raises if the programs cannot finish
    limits = rank_limits(memory_limit, schedule.ranks)
    if limits is not None:
        for rank, (peak, limit) in enumerate(zip(peak_memory(compute, sc), limits)):
            if not fits_memory(peak, limit):
                raise ScheduleError(f"rank {rank}: peak activation memory {peak:g} exceeds the limit {limit:g}")
    if schedule.is_lowered:
        _check_messages(schedule)
        check_rendezvous(schedule)
    elif check_lowering:
        lower(schedule, sc)
