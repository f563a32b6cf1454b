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
    action: Action,
    stages: int,
    stage_to_rank: Sequence[int],
    comm: float,
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


def consumers_of(action: Action, stages: int) -> list[Action]:
    """Actions that may wait on ``action`` (a superset; used to wake ranks up)."""
    s, k = action.stage, action.microbatch
    if action.kind == "F":
        out = [Action(s, "I", k), Action(s, "B", k)]
        if s < stages - 1:
            out.append(Action(s + 1, "F", k))
        return out
    if action.kind == "I":
        out = [Action(s, "W", k)]
        return out + ([Action(s - 1, "I", k), Action(s - 1, "B", k)] if s > 0 else [])
    if action.kind == "B":
        return [Action(s - 1, "I", k), Action(s - 1, "B", k)] if s > 0 else []
    return []


@dataclass(frozen=True)
class Timing:
    start: Mapping[Action, float]
    end: Mapping[Action, float]


def asap_timing(
    rows: Sequence[Sequence[Action]],
    stages: int,
    stage_to_rank: Sequence[int],
    duration: Callable[[Action], float],
    comm: float,
) -> Timing:
    """Start every action as early as its rank and inputs allow, in each rank's order.

    Raises ScheduleError naming every blocked rank, its waiting action and the missing input
    when the programs cannot finish (a dependency cycle across ranks or a missing producer).
    """
    rows = [tuple(row) for row in rows]
    backward_of = backward_index(rows)
    rank_of_action = {a: r for r, row in enumerate(rows) for a in row}
    position = [0] * len(rows)
    free_at = [0.0] * len(rows)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pending = list(range(len(rows)))
    while pending:
        rank = pending.pop()
        row = rows[rank]
        while position[rank] < len(row):
            action = row[position[rank]]
            ready = free_at[rank]
            blocked = False
            for dep in dependencies(action, stages, stage_to_rank, comm, backward_of):
                produced = end.get(dep.action)
                if produced is None:
                    blocked = True
                    break
                ready = max(ready, produced + dep.delay)
            if blocked:
                break
            start[action] = ready
            end[action] = free_at[rank] = ready + duration(action)
            position[rank] += 1
            for consumer in consumers_of(action, stages):
                other = rank_of_action.get(consumer)
                if other is not None and other != rank and rows[other][position[other]:position[other] + 1] == (consumer,):
                    pending.append(other)
    stuck = [r for r, row in enumerate(rows) if position[r] < len(row)]
    if stuck:
        lines = []
        for r in stuck:
            action = rows[r][position[r]]
            missing = [
                str(d.action)
                for d in dependencies(action, stages, stage_to_rank, comm, backward_of)
                if d.action not in end
            ]
            where = [
                f"{m} (rank {rank_of_action[Action.parse(m)]})" if Action.parse(m) in rank_of_action else f"{m} (in no rank's list)"
                for m in missing
            ]
            lines.append(f"rank {r} waits at {action} for {', '.join(where)}")
        raise ScheduleError("schedule cannot run to completion: " + "; ".join(lines))
    return Timing(start, end)
