"""Costs from the real machine: per-stage median times of F, I and W from the runners'
timelines of a few steps, and the time to send a stage's boundary tensors to the next rank
(half a measured round trip). With them the zb-auto solver schedules for this machine."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

from zbcompile.runtime.distributed import DistributedRunner
from zbcompile.runtime.p2p import gather_objects
from zbcompile.schedules import Action, Costs

Timeline = Sequence[tuple[str, float, float]]


def action_medians(timelines: Sequence[Timeline]) -> dict[tuple[int, str], float]:
    """(stage, kind) -> median seconds over every recorded action of that kind and stage. A fused
    backward B counts as I plus W and is reported under "B"."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for timeline in timelines:
        for text, start, end in timeline:
            action = Action.parse(text)
            samples[(action.stage, action.kind)].append(end - start)
    return {key: statistics.median(values) for key, values in samples.items()}


def round_trip_seconds(runner: DistributedRunner, repeats: int = 5) -> float:
    """Half the median round trip of the largest boundary message between this rank and the next
    pipeline rank (every rank takes part: even positions send first)."""
    layout = runner.layout
    values = runner.compiled.partition.values
    size = max([v.nbytes for v in values.values()] + [4])
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=runner.device)
    position, ranks = layout.pp_rank, layout.pipeline_ranks
    samples = []
    for _ in range(repeats):
        for sender in (0, 1):  # pairs (0,1), (2,3)... then (1,2), (3,4)...
            if (position - sender) % 2 == 0 and position + 1 < len(ranks):
                started = time.perf_counter()
                dist.send(buffer, ranks[position + 1])
                dist.recv(buffer, ranks[position + 1])
                samples.append((time.perf_counter() - started) / 2)
            elif (position - sender) % 2 == 1 and position >= 1:
                dist.recv(buffer, ranks[position - 1])
                dist.send(buffer, ranks[position - 1])
    return statistics.median(samples) if samples else 0.0


def measured_costs(runner: DistributedRunner, timelines: Sequence[Timeline], static: Costs) -> Costs:
    """Per-stage costs measured on every rank of this pipeline, gathered to all of them. Times
    in seconds; memory as in `static`."""
    local = action_medians(timelines)
    comm = round_trip_seconds(runner)
    gathered = gather_objects((local, comm), runner.layout.pp_group)
    medians: dict[tuple[int, str], float] = {}
    for part, _ in gathered:
        medians.update(part)
    stages = runner.schedule.stages

    def time_of(stage: int, kind: str) -> float:
        if (stage, kind) in medians:
            return medians[(stage, kind)]
        if kind in ("I", "W") and (stage, "B") in medians:  # only fused backwards ran: split by FLOPs
            share = static.w[stage] / max(static.b[stage] + static.w[stage], 1e-12) if isinstance(static.w, (list, tuple)) else 0.5
            return medians[(stage, "B")] * (share if kind == "W" else 1 - share)
        return 0.0

    return Costs(
        f=[time_of(s, "F") for s in range(stages)],
        b=[time_of(s, "I") for s in range(stages)],
        w=[time_of(s, "W") for s in range(stages)],
        comm=max(c for _, c in gathered),
        mem_f=static.mem_f,
        mem_w=static.mem_w,
    )
