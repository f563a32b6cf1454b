"""The forward-only schedule of evaluation: F of every microbatch on every stage, nothing else.

Each rank runs its F in the order they become ready under unit costs (a list schedule), a
deeper stage first among those ready at once, and every stage its microbatches in order. Nothing
is kept for a backward, so a rank holds only the microbatches in flight (an F's own values while
it runs, and outputs on their way to the next stage), however many microbatches there are.
"""

from __future__ import annotations

from typing import Sequence

from .ir import Action, Schedule


def forward_only(stage_to_rank: Sequence[int], microbatches: int, name: str = "forward-only") -> Schedule:
    """F of `microbatches` microbatches on stages placed by `stage_to_rank`, in each rank's order
    of readiness (compute actions only: `lower` adds the messages)."""
    if microbatches < 1:
        raise ValueError(f"a forward-only schedule needs at least one microbatch, got {microbatches}")
    stages, ranks = len(stage_to_rank), 1 + max(stage_to_rank)
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    next_microbatch = [0] * stages
    ended: dict[tuple[int, int], float] = {}
    free = [0.0] * ranks
    for _ in range(stages * microbatches):
        choices = []
        for s, k in enumerate(next_microbatch):
            if k == microbatches or (s > 0 and (s - 1, k) not in ended):
                continue
            rank = stage_to_rank[s]
            choices.append((max(free[rank], ended.get((s - 1, k), 0.0)), -s, k))
        start, minus_stage, k = min(choices)
        s = -minus_stage
        rank = stage_to_rank[s]
        rows[rank].append(Action(s, "F", k))
        ended[(s, k)] = free[rank] = start + 1.0
        next_microbatch[s] += 1
    return Schedule(name, stages, microbatches, tuple(stage_to_rank), tuple(tuple(row) for row in rows))
