"""Runs a whole pipeline step in one process: every stage's actions in an order the schedule
allows (each rank's list in order, dependencies first). Used when there is no process group,
and as the reference the distributed runtime must match bit for bit."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from zbcompile.runtime.stage import StageExecutor, mean_grad, merge_stage_grads
from zbcompile.schedules import Action, Schedule
from zbcompile.schedules.timing import asap_timing


def execution_order(schedule: Schedule) -> list[Action]:
    """All compute actions in an order that respects each rank's list and every dependency."""
    timing = asap_timing(schedule.actions, schedule.stages, schedule.stage_to_rank, lambda a: 1.0, 0.0)
    rank = {a: r for r, row in enumerate(schedule.actions) for a in row}
    return sorted(timing.start, key=lambda a: (timing.start[a], rank[a]))


def run_local_step(
    executors: Sequence[StageExecutor],
    schedule: Schedule,
    inputs: Sequence[Mapping[str, torch.Tensor]],
    targets: Sequence[Mapping[str, torch.Tensor]],
) -> list[torch.Tensor]:
    """One step over `len(inputs)` microbatches; returns each microbatch's loss. Parameter
    gradients of the mean loss stay in the executors (`take_grads`)."""
    microbatches = len(inputs)
    last = len(executors) - 1
    arriving: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}
    for action in execution_order(schedule):
        s, k = action.stage, action.microbatch
        executor = executors[s]
        if action.kind == "F":
            received = dict(inputs[k]) if s == 0 else arriving.pop(("F", s, k))
            if s == last:
                received.update(targets[k])
            outputs = executor.forward(k, received)
            if s == last:
                losses[k] = outputs["loss"]
            else:
                arriving[("F", s + 1, k)] = outputs
        elif action.kind in ("I", "B"):
            grads_in = {"loss": mean_grad(losses[k], microbatches)} if s == last else arriving.pop(("B", s, k))
            run = executor.input_backward if action.kind == "I" else executor.backward
            grads_out = run(k, grads_in)
            if s > 0:
                arriving[("B", s - 1, k)] = grads_out
        elif action.kind == "W":
            executor.weight_backward(k)
    return [losses[k] for k in range(microbatches)]



class LocalRunner:
    """Every stage of a pipeline in this process."""

    def __init__(self, executors: Sequence[StageExecutor], schedule: Schedule) -> None:
        self.executors = list(executors)
        self.schedule = schedule

    def step(self, inputs, targets) -> list[torch.Tensor]:
        return run_local_step(self.executors, self.schedule, inputs, targets)

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Parameters and buffers (`param:<fqn>`, `buffer:<fqn>`) the next step computes with."""
        for executor in self.executors:
            executor.state = state

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        return merge_stage_grads(self.executors)

    @property
    def peak_live_bytes(self) -> list[int]:
        return [e.peak_live_bytes for e in self.executors]
