"""Multi-process launches shared by tests in several modules. Process start-up is the
multi-process tests' largest cost, so one launch runs every four-rank check and one the
two-rank checks of several modules, each once per test session, started by the first test that
reads it (the tests that do share the xdist group "distributed", so they run in one process)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from helpers import (
    distributed_workers,
    pipelining_workers,
    post_validation_workers,
    precision_workers,
    real_model_workers,
    save_resume_workers,
)
from helpers.multiprocess import run_ranks

# post-validation on 4 ranks: a 4-stage pipeline, then 2 replicas x 2 stages
POST_VALIDATION_PIPELINES = [(4, ("sgd", "adam", "adamw")), (2, ("adamw",))]


def several(calls: list[tuple[str, Callable, tuple]]) -> dict[str, Any]:
    """On each rank: every (label, function, arguments) in order; label -> what it returned."""
    return {label: function(*arguments) for label, function, arguments in calls}


# what each of the four ranks runs: the battery of every model and schedule, the data-parallel
# replicas, pipelines over process groups and DeviceMeshes, post-validation, checkpoints across
# data_parallel modes
FOUR_RANK_CALLS = [
    ("battery", distributed_workers.one_step, (distributed_workers.battery_runs(4),)),
    ("replicas", distributed_workers.one_step, (distributed_workers.REPLICA_RUNS,)),
    ("groups", distributed_workers.pipelines_in_process_groups, ()),
    ("post_validation", post_validation_workers.train_all, (POST_VALIDATION_PIPELINES,)),
    ("dp_checkpoints", save_resume_workers.dp_checkpoints, ()),
]


@functools.cache
def four_ranks() -> list[dict]:
    """Every rank's results of `FOUR_RANK_CALLS`, launched once."""
    return run_ranks(4, several, FOUR_RANK_CALLS)


# what each of two ranks runs for tests/e2e: the library models built on the meta device, the
# bf16 Llama under every schedule, torch.distributed.pipelining over compiled stages (last: it
# leaves torch.compile's caches behind)
PIPELINING_SCHEDULES = ["interleaved-zb", "zbv"]
TWO_RANK_CALLS = [
    ("real_models", real_model_workers.meta_train, (real_model_workers.RUNS,)),
    ("precision", precision_workers.train_all_schedules, ()),
    ("pipelining", pipelining_workers.pipelined_steps, (PIPELINING_SCHEDULES,)),
]


@functools.cache
def two_ranks() -> list[dict]:
    """Every rank's results of `TWO_RANK_CALLS`, launched once."""
    return run_ranks(2, several, TWO_RANK_CALLS)


def two_rank_results(label: str) -> list:
    """Every rank's result of the `TWO_RANK_CALLS` entry `label`."""
    return [r[label] for r in two_ranks()]
