"""Train the example GPT as a zero-bubble pipeline under torchrun.

    torchrun --nproc-per-node 4 examples/train_gpt.py --stages 4
    torchrun --nproc-per-node 4 examples/train_gpt.py --stages 2      # 2 data-parallel replicas

Every rank runs this same script: the model is built on the meta device, each rank materialises
only its own stages' parameters, the schedule (zb-auto) is re-solved from costs measured over
the first steps, each data-parallel replica reads its own batches, and the rank holding the last
stage of each replica prints that replica's loss."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import zbcompile
from zbcompile.demo import text_batches
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import schedule_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="zb-auto")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=128, heads=4, layers=8))
    pipe = zbcompile.pipeline(
        model, stages=args.stages, microbatches=args.microbatches, loss_fn=lm_loss,
        schedule=args.schedule, profile=True,
    )
    # each data-parallel replica trains on its own batches (DDP's convention), the same on its pipeline's ranks
    replica = dist.get_rank() // schedule_spec(args.schedule).ranks(args.stages)
    batches = text_batches(batch=16, seq_len=64, seed=replica)
    tokens, targets = next(batches)
    pipe.compile(tokens.to(device), target=targets.to(device))  # before the optimizer: local parameters only
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(args.steps):
        tokens, targets = next(batches)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = pipe.step(tokens.to(device), target=targets.to(device))
        optimizer.step()
        if loss is not None:
            print(f"rank {dist.get_rank()} step {step:3d} loss {loss.item():.4f} {time.perf_counter() - started:.3f}s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
