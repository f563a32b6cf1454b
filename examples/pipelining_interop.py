"""torch.distributed.pipelining's zero-bubble schedules over stages compiled with the "zbcompile"
torch.compile backend.

    torchrun --nproc-per-node 2 examples/pipelining_interop.py --schedule interleaved-zb
    torchrun --nproc-per-node 2 examples/pipelining_interop.py --schedule zbv

What makes it work:
  1. Compile each stage module in place, `module.compile(backend="zbcompile")`: the schedules
     refuse `OptimizedModule` wrappers (`torch.compile(module)`), not in-place compilation. The
     module must be a user-defined class (Dynamo runs built-in `torch.nn` classes such as a bare
     `nn.Linear` eagerly, so nothing would be split).
  2. Give every `PipelineStage` `dw_builder=zbcompile.take_weight_grads`.
  3. Run `schedule.step()` inside `with zbcompile.defer_weight_grads():`. On an I action the stage
     runs autograd's backward, which runs each compiled region's I and queues its W; right after,
     the stage calls `dw_builder()`, which takes that W; the W action runs it.
  4. Pass example shapes to `PipelineStage` (`input_args`, `output_args`) so the first step does not
     run an extra shape-inference backward.

Every rank runs this script; each holds two stages (rank r: stages r and r + 2 interleaved;
stages r and 3 - r in the V shape of ZBV) of a 4-block MLP, and prints its parameters' gradient
norms after one step next to those of the same step run eagerly in one process.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

import zbcompile

SCHEDULES = {"interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
STAGES, HIDDEN, BATCH, MICROBATCHES = 4, 16, 8, 4


class Block(nn.Module):
    """One pipeline stage: a residual MLP block with a LayerNorm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def build_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(HIDDEN) for _ in range(STAGES)])


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, HIDDEN, generator=generator), torch.randn(BATCH, HIDDEN, generator=generator)


def stage_indices(schedule: str, rank: int, world: int) -> tuple[int, ...]:
    if schedule == "zbv":
        return (rank, 2 * world - 1 - rank)
    return tuple(range(rank, STAGES, world))


def pipelined_step(schedule: str) -> dict:
    """One step of `schedule` on this rank. Returns this rank's gradients by FQN of the whole
    model, the last stage's microbatch losses (or None), and how many backward passes handed
    queued W to `dw_builder`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    x, target = batch()
    microbatch = x.shape[0] // MICROBATCHES
    handed_over = []

    def dw_builder():
        store = zbcompile.active_store()
        handed_over.append(len(store) if store is not None else 0)
        return zbcompile.take_weight_grads()

    indices = stage_indices(schedule, rank, world)
    stages = []
    for index in indices:
        module = model[index]
        module.compile(backend="zbcompile")  # in place: no OptimizedModule wrapper
        # example shapes; requires_grad marks the values whose gradients travel between stages
        inputs = torch.empty(microbatch, HIDDEN, requires_grad=index > 0)
        outputs = torch.empty(microbatch, HIDDEN, requires_grad=True)
        stages.append(
            PipelineStage(
                module,
                index,
                STAGES,
                torch.device("cpu"),
                input_args=inputs,
                output_args=outputs,
                dw_builder=dw_builder,
            )
        )
    runner = SCHEDULES[schedule](stages, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    with zbcompile.defer_weight_grads() as store:
        runner.step(*((x,) if 0 in indices else ()), target=target if STAGES - 1 in indices else None, losses=losses)
        left_in_store = len(store)
    grads = {
        f"{index}.{name}": p.grad.clone()
        for index in indices
        for name, p in model[index].named_parameters()
    }
    return {"grads": grads, "losses": losses or None, "handed_over": handed_over, "left_in_store": left_in_store}


def eager_grads() -> dict[str, torch.Tensor]:
    """The same step in one process, eagerly: the mean of the microbatch losses."""
    model = build_model()
    x, target = batch()
    losses = [nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES))]
    torch.stack(losses).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved-zb")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        result = pipelined_step(args.schedule)
        reference = eager_grads()
        worst = max((result["grads"][k] - reference[k]).abs().max().item() for k in result["grads"])
        print(
            f"rank {dist.get_rank()}: stages {stage_indices(args.schedule, dist.get_rank(), dist.get_world_size())}, "
            f"{len(result['grads'])} gradients, largest difference from eager {worst:.2e}, "
            f"W handed to dw_builder {sum(1 for n in result['handed_over'] if n)} times"
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
