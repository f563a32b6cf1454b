"""Multi-process launches shared by tests in several modules. Process start-up is the
multi-process tests' largest cost, so one launch runs every four-rank check that needs no
earlier launch's output and two the two-rank checks that need a fresh pair of processes for
nothing (no rank dies, no exit code is read), each once per test session, started by the
first test that reads it (the tests that read one launch share its xdist group, `READS_...`,
so that `pytest -n` launches it in one worker)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from typing import Any, Callable

import pytest

from helpers import (
    data_parallel_workers,
    distributed_workers,
    inspect_workers,
    pipelining_workers,
    post_validation_workers,
    precision_workers,
    real_model_workers,
    recut_workers,
    save_resume_workers,
    step_path_workers,
    tensor_parallel_workers,
)
from helpers.multiprocess import run_ranks

Calls = list[tuple[str, Callable, tuple]]

READS_FOUR_RANKS = pytest.mark.xdist_group("four-ranks")
READS_TWO_RANKS = pytest.mark.xdist_group("two-ranks")
READS_TWO_RANK_MODELS = pytest.mark.xdist_group("two-rank-models")
READS_EIGHT_RANKS = pytest.mark.xdist_group("eight-ranks")
# set by conftest.py where the run groups tests by their xdist_group (`pytest -n N --dist loadgroup`)
GROUPED = "ZBCOMPILE_TESTS_GROUPED"
# how long a shared launch may run before its processes count as hung: each runs many pipelines in a
# row (5 minutes quiet for the two-rank one), two of them at once under `pytest -n 2`, and a CI-like
# load beside can slow them threefold; a hung wait inside fails sooner, on the pipelines' own timeouts
LAUNCH_TIMEOUT_S = 1800


def several(calls: Calls) -> dict[str, Any]:
    """On each rank: every (label, function, arguments) in order; label -> what it returned."""
    return {label: function(*arguments) for label, function, arguments in calls}


def once(group: pytest.MarkDecorator) -> Callable[[Callable[[], list]], Callable[[], list]]:
    """`launch` run by the first call only: later calls return its result, or raise its error
    again, so that a failed launch is not started anew by every test that reads it. Where tests
    run grouped, every call must come from a test marked with `group` (its `READS_...`): one
    unmarked could run in another worker, which would launch it all again."""
    name = group.args[0]

    def decorate(launch: Callable[[], list]) -> Callable[[], list]:
        outcome: list = []

        @functools.wraps(launch)
        def first_outcome() -> list:
            _check_group(name, launch.__name__)
            if not outcome:
                try:
                    outcome.append((launch(), None))
                except RuntimeError as error:
                    outcome.append((None, str(error)))
            result, error = outcome[0]
            if error is not None:
                raise RuntimeError(f"{launch.__name__}() failed:\n{error}")
            return result

        return first_outcome

    return decorate


def _check_group(group: str, launch: str) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    if os.environ.get(GROUPED) and test and not test.endswith(f"@{group}"):
        raise RuntimeError(
            f"{test} reads the shared launch {launch}() but is not in its xdist group {group!r}: mark the test "
            f"with the launch's READS_... mark (helpers/launches.py), or the launch runs again in another worker"
        )


@functools.cache
def directory(launch: str) -> str:
    """A directory of its own for what `launch`'s ranks write (dumps, checkpoints), removed at exit."""
    path = tempfile.mkdtemp(prefix=f"zbcompile-{launch}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# --- four ranks ------------------------------------------------------------------------------

# post-validation on 4 ranks: a 4-stage pipeline, then 2 replicas x 2 stages
POST_VALIDATION_PIPELINES = [(4, ("sgd", "adam", "adamw")), (2, ("adamw",))]
# tests/runtime/test_recut.py: (stages, data_parallel, meta init, forced) of the pipelines that re-cut
FOUR_RANK_RECUTS = [(2, "shard", True, None), (2, "replicate", False, "flip"), (4, "replicate", True, None)]
# (a rank slowed into a re-cut races at four ranks above: two ranks run the forced outcomes only)
TWO_RANK_RECUTS = [(2, "replicate", False, "slower"), (2, "replicate", False, "rival")]


def four_rank_calls(out: str) -> Calls:
    """What each of the four ranks runs, in order: the battery of every model and schedule, the
    data-parallel replicas, pipelines over process groups and DeviceMeshes, post-validation,
    checkpoints across data_parallel modes, tensor parallelism (pp=2 x tp=2: its dump and
    checkpoints in `out`/tensor_parallel), re-cuts by measurement, then data_parallel="replicate"
    and "shard" (its dump and checkpoint in `out`; the batches that fail on purpose come last)."""
    return [
        ("battery", distributed_workers.one_step, (distributed_workers.battery_runs(4),)),
        ("replicas", distributed_workers.one_step, (distributed_workers.REPLICA_RUNS,)),
        ("groups", distributed_workers.pipelines_in_process_groups, ()),
        ("post_validation", post_validation_workers.train_all, (POST_VALIDATION_PIPELINES,)),
        ("dp_checkpoints", save_resume_workers.dp_checkpoints, ()),
        ("tensor_parallel", tensor_parallel_workers.four_ranks, (os.path.join(out, "tensor_parallel"),)),
        ("recut", recut_workers.recut_runs, (FOUR_RANK_RECUTS,)),
        ("data_parallel", data_parallel_workers.train, (data_parallel_workers.RUNS, out)),
    ]


@once(READS_FOUR_RANKS)
def four_ranks() -> list[dict]:
    """Every rank's results of `four_rank_calls`, launched once."""
    return run_ranks(4, several, four_rank_calls(directory("four-ranks")), timeout=LAUNCH_TIMEOUT_S)


def four_rank_results(label: str) -> list:
    """Every rank's result of the `four_rank_calls` entry `label`."""
    return [r[label] for r in four_ranks()]


# --- eight ranks ------------------------------------------------------------------------------


@once(READS_EIGHT_RANKS)
def eight_ranks() -> list[dict]:
    """Every rank's results of the eight-rank checks (dp=2 x pp=2 x tp=2), launched once."""
    calls = [("tensor_parallel", tensor_parallel_workers.eight_ranks, ())]
    return run_ranks(8, several, calls, timeout=LAUNCH_TIMEOUT_S)


# --- two ranks -------------------------------------------------------------------------------

# tests/runtime/test_distributed.py: 3 steps of each (schedule, optimizer); the profiled runs'
# (max_steps, options: "slowed rank" slows rank 0 so that the measured solve differs from the static
# one and is tried against it); batches that leave some microbatches out; forward messages delayed by
# 0.1 s (W may fit in the waits; which ones depends on the machine) and, on rank 1, never seen
# arrived before a computation waits for them (the W the plan put before it always move there)
TRAIN = ("gpt", ("zb-h1", "dualpipe"), 2, ("sgd", "adamw"), 3)
PROFILED = {
    "default": (400, {}),
    "below 1f1b": (400, {"memory_limit": 1.5, "recut": False}),
    "slowed rank": (400, {"recut": False, "_slowdown": {0: 3.0}}),
    "profile=False": (5, {"profile": False}),
    "profile=True": (400, {"schedule": "zb-h1", "profile": True, "profile_steps": 3}),
    "recompute auto": (400, {"memory_limit": 1.5, "recompute": "auto"}),
}
PARTIAL_RUNS = [("masked", "zb-h1", 2), ("gpt", "zbv", 4)]
LATE_STEPS = 3
# tests/runtime/test_post_validation.py: a 2-stage pipeline, each optimizer
POST_VALIDATION_TWO_RANKS = [(2, ("sgd", "adam", "adamw"))]
# tests/runtime/test_buffer_updates.py: (stages, schedule) of the BatchNorm ConvNet; its
# microbatches and SGD steps (the second step's forwards read the statistics the first left)
BUFFER_RUNS, BUFFER_MICROBATCHES, BUFFER_STEPS = [(2, "zb-h1"), (4, "zbv"), (1, "1f1b")], 4, 2
# tests/e2e/test_inspect.py: the steps of the dumped zb-h1 run
INSPECT_STEPS = 3


def two_rank_calls(out: str) -> Calls:
    """What each of the two ranks runs, in order: the path of a step to its first send (first:
    nothing else has run in the process), the battery, post-validation, buffer updates, a
    dumped run (into `out`), training, meta init, profiled runs, new shapes, re-cuts, then the batches
    that fail on purpose (last: a rank that waits out its timeout closes the connection)."""
    return [
        ("step_path", step_path_workers.files_before_first_send, ()),
        ("battery", distributed_workers.one_step, (distributed_workers.battery_runs(2),)),
        ("post_validation", post_validation_workers.train_all, (POST_VALIDATION_TWO_RANKS,)),
        ("buffers", distributed_workers.buffer_update_steps, (BUFFER_RUNS, BUFFER_MICROBATCHES, BUFFER_STEPS)),
        ("inspect", inspect_workers.dumped_steps, (out, "zb-h1", INSPECT_STEPS)),
        ("train", distributed_workers.train, TRAIN),
        ("meta_init", distributed_workers.meta_init, (2,)),
        ("profiled", distributed_workers.profiled_runs, (list(PROFILED.values()),)),
        ("new_shapes", distributed_workers.new_shapes_recompile, ()),
        ("variable_lengths", distributed_workers.variable_lengths, ()),
        ("recut", recut_workers.recut_runs, (TWO_RANK_RECUTS,)),
        ("partial", distributed_workers.partial_batches, (PARTIAL_RUNS,)),
        ("late", distributed_workers.late_messages, (0.1, LATE_STEPS)),
        ("misplaced", distributed_workers.misplaced_batches, ()),
    ]


@once(READS_TWO_RANKS)
def two_ranks() -> list[dict]:
    """Every rank's results of `two_rank_calls`, launched once."""
    return run_ranks(2, several, two_rank_calls(directory("two-ranks")), timeout=LAUNCH_TIMEOUT_S)


# what each of two ranks runs for tests/e2e, a launch of its own: the library models built on
# the meta device, the bf16 Llama under every schedule, torch.distributed.pipelining over
# compiled stages (last: it leaves torch.compile's caches behind)
PIPELINING_SCHEDULES = ["interleaved-zb", "zbv"]
TWO_RANK_MODEL_CALLS = [
    ("real_models", real_model_workers.meta_train, (real_model_workers.RUNS,)),
    ("precision", precision_workers.train_all_schedules, ()),
    ("pipelining", pipelining_workers.pipelined_steps, (PIPELINING_SCHEDULES,)),
]


@once(READS_TWO_RANK_MODELS)
def two_rank_models() -> list[dict]:
    """Every rank's results of `TWO_RANK_MODEL_CALLS`, launched once."""
    return run_ranks(2, several, TWO_RANK_MODEL_CALLS, timeout=LAUNCH_TIMEOUT_S)


def two_rank_results(label: str) -> list:
    """Every rank's result of the entry `label` of `two_rank_calls` or `TWO_RANK_MODEL_CALLS`."""
    models = {name for name, _, _ in TWO_RANK_MODEL_CALLS}
    return [r[label] for r in (two_rank_models() if label in models else two_ranks())]
