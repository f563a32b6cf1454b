"""Runs a whole pipeline step in one process: the interpreter (`runtime/step/dispatch.py`) follows
every rank's program merged into one (`program.single_process_program`: each rank's list in
order, dependencies first), and messages between ranks go through a dict. Used when there is no
process group, and as the reference the distributed runtime must match bit for bit.

A mirrored schedule (dualpipe) runs here with both copies of every stage, each for its
microbatches, and sums their gradients as the ranks holding them would (`reduce_grads`)."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.step.rank_program import RankProgram, single_process_program
from zbcompile.runtime.step.runner import Runner
from zbcompile.runtime.step.stage import StageExecutor, merge_stage_grads
from zbcompile.runtime.step.tied_weights import holder_positions, parameter_users
from zbcompile.schedules import Schedule


class InProcessTransport:
    """Messages between the stages of one process: a send leaves its tensors under the message's
    tag (distinct per message of a step) and the receive takes them as they are, no copy. The
    program puts every send before the computation that waits for it, so nothing blocks."""

    matches_by_tag = True

    def __init__(self) -> None:
        self._sent: dict[int, Sequence[torch.Tensor]] = {}

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str, watch: bool = False) -> int:
        return tag

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        self._sent[tag] = tensors

    def can_tell(self, pending: int) -> bool:
        return True

    def arrived(self, pending: int) -> bool:
        return pending in self._sent

    def wait(self, pending: int, waiting_action: str) -> list[torch.Tensor]:
        return list(self._sent.pop(pending))

    def arrival_time(self, pending: Any) -> float | None:
        return None

    def complete_messages(self) -> None:
        pass


class LocalRunner(Runner):
    """Every stage of a pipeline in this process."""

    def __init__(self, compiled: CompiledPipeline, schedule: Schedule, state: Mapping[str, torch.Tensor]) -> None:
        executors = {p.index: StageExecutor(p, state) for p in compiled.programs}
        super().__init__(compiled, schedule, executors, InProcessTransport(), None, False, None, copies={})

    def _program(self, schedule: Schedule) -> RankProgram:
        """The merged program; for a mirrored schedule, a second executor per stage (its copy)."""
        self.copies.clear()
        if schedule.mirrored_from is not None:
            state = self.executors[0].state
            self.copies.update({s: StageExecutor(self.compiled.programs[s], state) for s in range(schedule.stages)})
        return single_process_program(schedule, self._message_names, self._value_layout)

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        """The stages' gradients summed in stage order; under a mirrored schedule, as its ranks
        sum them (`DistributedRunner.reduce_grads`): each rank's stages in stage order, then a
        parameter held by several ranks over them in pipeline order (`tied_weights.holder_positions`)."""
        schedule = self.schedule
        if schedule.mirrored_from is None:
            return self._stage_grads()
        own = []
        for rank in range(schedule.ranks):
            on_rank = schedule.stages_on(rank)
            held = [self.executors[s] if schedule.stage_to_rank[s] == rank else self.copies[s] for s in on_rank]
            own.append(merge_stage_grads(held))
        grads = {}
        for fqn, stages in parameter_users(self.compiled.partition).items():
            parts = [own[rank][fqn] for rank in holder_positions(stages, schedule.ranks_of) if fqn in own[rank]]
            if parts:
                grads[fqn] = functools.reduce(torch.add, parts)
        return grads

