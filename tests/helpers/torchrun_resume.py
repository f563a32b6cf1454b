"""A training run for torchrun (`test_torchrun_restart.py`): every rank runs the uninterrupted
run first (attempt 0 only), then the run with checkpoints every CHECKPOINT_EVERY steps, resuming
from the latest complete one; on attempt 0, rank 1 is SIGKILLed in the middle of step KILLED_AT.
Writes each rank's final parameters and optimizer state for both runs to the directory given.

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 torchrun_resume.py DIR
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.save_resume_workers import make_run, snapshot, train
from zbcompile import checkpoint

STEPS = 6
CHECKPOINT_EVERY = 2
KILLED_AT = 4  # rank 1 dies in this step (counted from 0) on the first attempt
SEED = 1234  # the dropout masks' (per rank)


def die_in_forward(pipe) -> None:
    """SIGKILL this process when its first stage starts the forward of microbatch 1."""
    executor = pipe.executors[0]
    original = executor.forward

    def forward(microbatch, inputs):
        if microbatch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(microbatch, inputs)

    executor.forward = forward


def main(directory: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0:
        pipe, opt = make_run(0)
        torch.manual_seed(SEED + rank)
        train(pipe, opt, 0, STEPS)
        torch.save(snapshot(pipe, opt), os.path.join(directory, f"uninterrupted{rank}.pt"))
        opt.close()
    pipe, opt = make_run(0)
    torch.manual_seed(SEED + rank)
    checkpoints = os.path.join(directory, "checkpoints")
    latest, start = checkpoint.latest(checkpoints), 0
    if latest is not None:
        start = checkpoint.load(latest, pipe, opt)["next_step"]
        print(f"rank {rank}: attempt {attempt} resumed from {os.path.basename(latest)}", flush=True)
    for step in range(start, STEPS):
        if attempt == 0 and rank == 1 and step == KILLED_AT:
            die_in_forward(pipe)
        started = time.monotonic()
        try:
            train(pipe, opt, step, 1)
        except Exception as error:
            seconds = time.monotonic() - started
            message = f"rank {rank} failed in step {step} after {seconds:.1f} s: {type(error).__name__}: {error}"
            print(message, file=sys.stderr, flush=True)
            raise
        if (step + 1) % CHECKPOINT_EVERY == 0:
            checkpoint.save(os.path.join(checkpoints, f"step_{step + 1}"), pipe, opt, next_step=step + 1)
    torch.save(snapshot(pipe, opt), os.path.join(directory, f"resumed{rank}.pt"))
    opt.close()  # the last messages have left before the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
