"""Run a function on N local processes joined in a gloo process group, and collect what each
returns. Used by the multi-process tests."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> list[Any]:
    """`fn(*args)` on `world` processes (rank r's result at index r); raises if any fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world, _free_port(), out_dir, fn, args), nprocs=world, start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
