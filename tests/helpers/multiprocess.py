"""Run a function on N local processes joined in a gloo process group, and collect what each
returns. Used by the multi-process tests."""

from __future__ import annotations

import os
import pickle
import random
import socket
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Failed:
    """A rank that raised (`error` holds its traceback) or exited without a result."""

    rank: int
    exitcode: int | None
    error: str


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port bound to 0 and closed comes from
    that range, where the other launches' gloo connections take their ports too, and one may take
    it before rank 0's store listens on it (EADDRINUSE)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        result = fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = Failed(rank, None, traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if not isinstance(result, Failed):
        dist.destroy_process_group()


def replica_of(ranks_per_pipeline: int) -> tuple[int, int]:
    """(data-parallel replicas, this rank's replica) when pipelines of `ranks_per_pipeline`
    ranks span the world (the default ("dp", "pp") mesh: consecutive ranks form a pipeline)."""
    return dist.get_world_size() // ranks_per_pipeline, dist.get_rank() // ranks_per_pipeline


def run_ranks(world: int, fn: Callable, *args: Any, allow_failures: bool = False, timeout: float = 600) -> list[Any]:
    """`fn(*args)` on `world` processes; rank r's result at index r. A rank that raised or died
    gives a `Failed`; unless `allow_failures`, any failure raises RuntimeError with the traces."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        processes = [context.Process(target=_entry, args=(r, world, port, out_dir, fn, args)) for r in range(world)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for rank, p in enumerate(processes):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(Failed(rank, p.exitcode, f"rank {rank} exited with code {p.exitcode} and no result"))
    failures = [r for r in results if isinstance(r, Failed)]
    if failures and not allow_failures:
        raise RuntimeError("\n".join(f"--- rank {f.rank}:\n{f.error}" for f in failures))
    return results
