"""Run a function on N local processes joined in one gloo process group, and collect what each
returns: the launch of `zbcompile rehearse`, the demo's port, the tests and the benchmarks."""

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


@dataclass(frozen=True)
class Failed:
    """A rank that raised (`error` holds its traceback) or exited without a result."""

    rank: int
    exitcode: int | None
    error: str


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port bound to 0 and closed comes from
    that range, where other launches' gloo connections take their ports too, and one may take it
    before rank 0's store listens on it (EADDRINUSE)."""
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


# what the fork server imports once, before it forks the ranks (`_start_context`)
PRELOAD = ("__main__", "torch", "torch.distributed")


def _start_context(fn: Callable) -> Any:
    """The forkserver context where the platform has one: every rank is a fork of one server that
    imported torch and `fn`'s module when it started (the first launch of this process), so that
    a launch of 32 ranks starts in seconds, not in 32 interpreters importing torch; else spawn.
    Each rank then takes its launcher's environment (`_entry`) and directory, as a spawned one would."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, fn.__module__])))
    return context


def _entry(
    rank: int, world: int, port: int, out_dir: str, timeout_s: float, environ: dict, fn: Callable, args: tuple
) -> None:
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = Failed(rank, None, traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if not isinstance(result, Failed):
        dist.destroy_process_group()


def run_ranks(
    world: int, fn: Callable, *args: Any, timeout_s: float = 600.0, group_timeout_s: float | None = None,
    allow_failures: bool = False,
) -> list[Any]:
    """`fn(*args)` on `world` local processes (one intra-op thread each) in a gloo group on
    127.0.0.1 whose collectives time out after `group_timeout_s` (default `timeout_s`); a process
    still running `timeout_s` after it was waited for is killed. Rank r's result at index r; a rank
    that raised or died gives a `Failed`; unless `allow_failures`, any failure raises RuntimeError
    with the traces."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = _start_context(fn)
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        launch = (world, port, out_dir, group_timeout_s or timeout_s, dict(os.environ), fn, args)
        processes = [context.Process(target=_entry, args=(r, *launch)) for r in range(world)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(timeout_s)
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
