"""Multi-process launches shared by tests in several modules. Four processes on a small machine
are the suite's most expensive start-up, so one launch runs every four-rank check, once per test
session, started by the first test that reads it (the tests that do share the xdist group
"distributed", so they run in one process)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from helpers import distributed_workers, post_validation_workers, save_resume_workers
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
