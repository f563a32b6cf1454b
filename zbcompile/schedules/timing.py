"""Data dependencies between compute actions and as-soon-as-possible timing of per-rank programs.

Dependencies (p = number of stages):
  F(s, k) after F(s-1, k)                      (s > 0; plus ``comm`` when the stages sit on different ranks)
  I(s, k) / B(s, k) after F(s, k) and after the backward (I or B) of (s+1, k)   (s < p-1; plus ``comm``)
  W(s, k) after I(s, k)
Each rank runs its list in order; an action starts when its rank is free and its inputs have
arrived. That is what the runtime does, and it is the timing every measure in this package uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .ir import Action

BACKWARD_KINDS = ("I", "B")


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the action and the rule."""


@dataclass(frozen=True)
class Dependency:
    action: Action
    delay: float  # communication delay added to the producer's end


def backward_index(rows: Sequence[Sequence[Action]]) -> dict[tuple[int, int], Action]:
    """(stage, microbatch) -> that microbatch's backward action (I or B) on that stage."""
    return {(a.stage, a.microbatch): a for row in rows for a in row if a.kind in BACKWARD_KINDS}


def dependencies(
    action: Action, stages: int, stage_to_rank: Sequence[int], comm: float,
    backward_of: Mapping[tuple[int, int], Action],
) -> list[Dependency]:
    """The producers ``action`` waits for, with the communication delay on each edge."""
    s, k = action.stage, action.microbatch

    def delay(other_stage: int) -> float:
        return comm if stage_to_rank[other_stage] != stage_to_rank[s] else 0.0

    if action.kind == "F":
        return [Dependency(Action(s - 1, "F", k), delay(s - 1))] if s > 0 else []
    if action.kind in BACKWARD_KINDS:
        deps = [Dependency(Action(s, "F", k), 0.0)]
        if s < stages - 1:
            downstream = backward_of.get((s + 1, k), Action(s + 1, "I", k))
            deps.append(Dependency(downstream, delay(s + 1)))
        return deps
    if action.kind == "W":
        return [Dependency(Action(s, "I", k), 0.0)]
    raise ValueError(f"{action} is not a compute action")


@dataclass(frozen=True)
class Timing:
    start: Mapping[Action, float]
    end: Mapping[Action, float]


def asap_timing(
    rows: Sequence[Sequence[Action]], stages: int, stage_to_rank: Sequence[int], duration: Callable[[Action], float],
    comm: float,
) -> Timing:
    """Start every action as early as its rank and inputs allow, in each rank's order.

    Raises ScheduleError naming every blocked rank, its waiting action and the missing input
    when the programs cannot finish (a dependency cycle across ranks or a missing producer).
    """
    rows = [tuple(row) for row in rows]
    # Work on (stage, kind, microbatch) tuples: creating Action objects in the inner loop is slow.
    backward_kind = {(a.stage, a.microbatch): a.kind for row in rows for a in row if a.kind in BACKWARD_KINDS}
    rank_of = {(a.stage, a.kind, a.microbatch): r for r, row in enumerate(rows) for a in row}
    position = [0] * len(rows)
    free_at = [0.0] * len(rows)
    start: dict[tuple, float] = {}
    end: dict[tuple, float] = {}

    def producers(s: int, kind: str, k: int) -> list[tuple[tuple, float]]:
        here = stage_to_rank[s]
        if kind == "F":
            return [((s - 1, "F", k), comm if stage_to_rank[s - 1] != here else 0.0)] if s > 0 else []
        if kind == "W":
            return [((s, "I", k), 0.0)]
        deps = [((s, "F", k), 0.0)]
        if s < stages - 1:
            deps.append(((s + 1, backward_kind.get((s + 1, k), "I"), k), comm if stage_to_rank[s + 1] != here else 0.0))
        return deps

    pending = list(range(len(rows)))
    while pending:
        rank = pending.pop()
        row = rows[rank]
        while position[rank] < len(row):
            action = row[position[rank]]
            key = (action.stage, action.kind, action.microbatch)
            ready = free_at[rank]
            blocked = False
            for dep, dep_delay in producers(*key):
                produced = end.get(dep)
                if produced is None:
                    blocked = True
                    break
                if produced + dep_delay > ready:
                    ready = produced + dep_delay
            if blocked:
                break
            start[key] = ready
            end[key] = free_at[rank] = ready + duration(action)
            position[rank] += 1
            s, kind, k = key
            if kind == "F":
                wake = [(s + 1, "F", k)] if s < stages - 1 else []
            elif kind in BACKWARD_KINDS and s > 0:
                wake = [(s - 1, "I", k), (s - 1, "B", k)]
            else:
                wake = []
            for consumer in wake:
                other = rank_of.get(consumer)
                if other is not None and other != rank and position[other] < len(rows[other]):
                    head = rows[other][position[other]]
                    if (head.stage, head.kind, head.microbatch) == consumer:
                        pending.append(other)
    stuck = [r for r, row in enumerate(rows) if position[r] < len(row)]
    if stuck:
        lines = []
        for r in stuck:
            action = rows[r][position[r]]
            missing = [dep for dep, _ in producers(action.stage, action.kind, action.microbatch) if dep not in end]
            where = [
                f"{Action(*m)} (rank {rank_of[m]})" if m in rank_of else f"{Action(*m)} (in no rank's list)"
                for m in missing
            ]
            lines.append(f"rank {r} waits at {action} for {', '.join(where)}")
        raise ScheduleError("schedule cannot run to completion: " + "; ".join(lines))
    by_key = {(a.stage, a.kind, a.microbatch): a for row in rows for a in row}
    return Timing({by_key[k]: t for k, t in start.items()}, {by_key[k]: t for k, t in end.items()})
