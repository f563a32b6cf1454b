"""What each rank runs in the inspection tests (importable by spawned processes)."""

from __future__ import annotations

import time

import torch.distributed as dist

import zbcompile
from helpers.models import build


def dumped_steps(dump_dir: str, schedule: str, steps: int) -> dict:
    """`steps` steps of the MLP on a 2-stage pipeline that dumps into `dump_dir`; returns this
    rank's explain() text (once every rank has written its timeline) and the lowered schedule
    this rank ran, and each step's start and end on this rank (`time.perf_counter()`, the clock the
    runtime's timelines use: one clock for the processes of a host)."""
    case = build("mlp")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule=schedule, timeout=60,
        solver_time_budget=0.5, dump_dir=dump_dir,
    )
    windows = []
    for _ in range(steps):
        pipe.zero_grad()
        started = time.perf_counter()
        case.step(pipe)
        windows.append((started, time.perf_counter()))
    dist.barrier()  # the test's own synchronisation: every rank's last step is on disk
    return {"explain": pipe.explain(), "actions": [str(a) for a in pipe.runner.actions], "windows": windows}
