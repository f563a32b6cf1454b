"""Runs a whole pipeline step in one process: the interpreter (`runtime/dispatch.py`) follows
every rank's program merged into one (`program.single_process_program`: each rank's list in
order, dependencies first), and messages between ranks go through a dict. Used when there is no
process group, and as the reference the distributed runtime must match bit for bit."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.program import RankProgram, single_process_program
from zbcompile.runtime.runner import Runner
from zbcompile.runtime.stage import StageExecutor
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

    def flush_sends(self) -> None:
        pass


class LocalRunner(Runner):
    """Every stage of a pipeline in this process."""

    def __init__(self, compiled: CompiledPipeline, schedule: Schedule, state: Mapping[str, torch.Tensor]) -> None:
        executors = {p.index: StageExecutor(p, state) for p in compiled.programs}
        super().__init__(compiled, schedule, executors, InProcessTransport(), None, False, None)

    def _program(self, schedule: Schedule) -> RankProgram:
        return single_process_program(schedule, self._message_names, self._value_layout)

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        return self._stage_grads()

