"""Run a function on N local processes joined in a gloo process group, and collect what each
returns. Used by the multi-process tests."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from zbcompile.runtime.parallel import local_ranks
from zbcompile.runtime.parallel.local_ranks import Failed, free_port  # noqa: F401 (the tests take them from here)


def replica_of(ranks_per_pipeline: int) -> tuple[int, int]:
    """(data-parallel replicas, this rank's replica) when pipelines of `ranks_per_pipeline`
    ranks span the world (the default ("dp", "pp") mesh: consecutive ranks form a pipeline)."""
    return dist.get_world_size() // ranks_per_pipeline, dist.get_rank() // ranks_per_pipeline


def run_ranks(world: int, fn: Callable, *args: Any, allow_failures: bool = False, timeout: float = 600) -> list[Any]:
    """`fn(*args)` on `world` processes; rank r's result at index r (`local_ranks.run_ranks`)."""
    return local_ranks.run_ranks(world, fn, *args, timeout_s=timeout, group_timeout_s=60, allow_failures=allow_failures)
