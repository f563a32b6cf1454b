"""What one compute action of a step does, whatever carries the messages between stages.

F takes the microbatch's inputs (first stage) or the values that arrived from the previous stage
(and the targets on the last stage); I and B take the gradient of the mean loss (last stage) or
the gradients that arrived from the next stage; W takes nothing. What F, I and B produce for a
neighbour goes to `deliver`. The single-process runner and the distributed runner differ only in
their `fetch` and `deliver`."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from zbcompile.runtime.stage import StageExecutor, mean_grad
from zbcompile.schedules import Action

Values = dict[str, torch.Tensor]
# fetch(direction, stage, microbatch, waiting_action) -> the values stage `stage` receives:
# direction "F" = from the previous stage, "B" = gradients from the next stage.
Fetch = Callable[[str, int, int, str], Values]
# deliver(direction, stage, microbatch, values): `values` are for stage `stage`.
Deliver = Callable[[str, int, int, Values], None]


class StepDispatch:
    """Runs the compute actions of one step on `executors` (the stages this process holds, by
    stage index) and keeps the last stage's microbatch losses."""

    def __init__(
        self,
        executors: Mapping[int, StageExecutor],
        stages: int,
        inputs: Sequence[Mapping[str, torch.Tensor]],
        targets: Sequence[Mapping[str, torch.Tensor]],
        fetch: Fetch,
        deliver: Deliver,
    ) -> None:
        self.executors = executors
        self.last = stages - 1
        self.inputs = inputs
        self.targets = targets
        self.fetch = fetch
        self.deliver = deliver
        self.losses: dict[int, torch.Tensor] = {}

    def run(self, action: Action) -> float:
        """Execute compute action `action`; returns the `time.perf_counter()` at which its inputs
        were there and the computation began."""
        s, k, kind = action.stage, action.microbatch, action.kind
        executor = self.executors[s]
        if kind == "F":
            feed = dict(self.inputs[k]) if s == 0 else self.fetch("F", s, k, str(action))
            if s == self.last:
                feed.update(self.targets[k])
            started = time.perf_counter()
            outputs = executor.forward(k, feed)
            if s == self.last:
                self.losses[k] = outputs["loss"]
            else:
                self.deliver("F", s + 1, k, outputs)
        elif kind in ("I", "B"):
            if s == self.last:
                grads_in = {"loss": mean_grad(self.losses[k], len(self.inputs))}
            else:
                grads_in = self.fetch("B", s, k, str(action))
            started = time.perf_counter()
            grads_out = (executor.input_backward if kind == "I" else executor.backward)(k, grads_in)
            if s > 0:
                self.deliver("B", s - 1, k, grads_out)
        elif kind == "W":
            started = time.perf_counter()
            executor.weight_backward(k)
        else:
            raise ValueError(f"{action} is not a compute action (F, I, B or W)")
        return started

    def microbatch_losses(self) -> list[torch.Tensor]:
        """The losses of every microbatch, in order (only where this process holds the last stage)."""
        return [self.losses[k] for k in range(len(self.inputs))]
