"""Runs a whole pipeline step in one process: every stage's actions in an order the schedule
allows (each rank's list in order, dependencies first). Used when there is no process group,
and as the reference the distributed runtime must match bit for bit."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from zbcompile.runtime.dispatch import StepDispatch
from zbcompile.runtime.stage import StageExecutor, merge_stage_grads
from zbcompile.schedules import Action, Schedule
from zbcompile.schedules.timing import asap_timing


def execution_order(schedule: Schedule) -> list[Action]:
    """All compute actions in an order that respects each rank's list and every dependency."""
    timing = asap_timing(schedule.actions, schedule.stages, schedule.stage_to_rank, lambda a: 1.0, 0.0)
    rank = {a: r for r, row in enumerate(schedule.actions) for a in row}
    return sorted(timing.start, key=lambda a: (timing.start[a], rank[a]))


def run_local_step(
    executors: Sequence[StageExecutor],
    order: Sequence[Action],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    targets: Sequence[Mapping[str, torch.Tensor]],
) -> list[torch.Tensor]:
    """One step over `len(inputs)` microbatches, running the compute actions in `order` (a
    schedule's `execution_order`); returns each microbatch's loss. Parameter gradients of the
    mean loss stay in the executors (`take_grads`)."""
    arriving: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}

    def fetch(direction: str, stage: int, microbatch: int, action: str) -> dict[str, torch.Tensor]:
        return arriving.pop((direction, stage, microbatch))

    def deliver(direction: str, stage: int, microbatch: int, values: dict[str, torch.Tensor]) -> None:
        arriving[(direction, stage, microbatch)] = values

    dispatch = StepDispatch(dict(enumerate(executors)), len(executors), inputs, targets, fetch, deliver)
    for action in order:
        dispatch.run(action)
    return dispatch.microbatch_losses()


class LocalRunner:
    """Every stage of a pipeline in this process."""

    def __init__(self, executors: Sequence[StageExecutor], schedule: Schedule) -> None:
        self.executors = list(executors)
        self.schedule = schedule

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @schedule.setter
    def schedule(self, schedule: Schedule) -> None:
        self._schedule = schedule
        self._order = execution_order(schedule)

    def step(self, inputs, targets) -> list[torch.Tensor]:
        return run_local_step(self.executors, self._order, inputs, targets)

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Parameters and buffers (`param:<fqn>`, `buffer:<fqn>`) the next step computes with."""
        for executor in self.executors:
            executor.state = state

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        return merge_stage_grads(self.executors)

    @property
    def peak_live_bytes(self) -> list[int]:
        return [e.peak_live_bytes for e in self.executors]
