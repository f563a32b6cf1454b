"""What each rank runs in the checkpoint tests (importable by spawned processes), and the run
they share: a small GPT with dropout and tied embeddings, AdamW with weight decay behind the
post-validated optimizer (clipping at 0.5), a deterministic batch per step."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import zbcompile
from helpers.models import BATCH, GPT_CONFIG, share
from helpers.multiprocess import replica_of
from zbcompile import checkpoint
from zbcompile.models import GPT
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import make_schedule

CONFIG = dataclasses.replace(GPT_CONFIG, dropout=0.1)
SAVED_AT = 2  # steps before the checkpoint
RESUMED = 3  # steps after it
OTHER_CUT = ("blocks.1",)  # a cut no balanced compile of 2 stages makes


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step `step` (tokens, next tokens)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return tuple(torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=generator) for _ in range(2))


def make_run(seed: int, stages: int = 2, meta: bool = False, **options: Any) -> tuple[Any, Any]:
    """(pipe, optimizer) for a model initialised from `seed` (built on the meta device: each rank
    materialises its stages' parameters), compiled (distributed: placed) at the compiler's cut
    (`recut=False`: these runs compare layouts, which a cut chosen by measurement would vary)."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(CONFIG)
    pipe = zbcompile.pipeline(
        model, stages=stages, microbatches=4, loss_fn=lm_loss, timeout=60, solver_time_budget=0,
        **{"recut": False, **options},
    )
    pipe.compile(batch(0)[0], target=batch(0)[1])
    inner = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    return pipe, zbcompile.PostValidatedOptimizer(inner, pipe, max_norm=0.5)


def train(pipe: Any, optimizer: Any, first: int, count: int, batches: Callable[[int], Any] | None = None) -> None:
    """Steps `first` .. `first + count - 1`, each on `batches(step)` (default: `batch`)."""
    for step in range(first, first + count):
        tokens, target = (batches or batch)(step)
        pipe.step(tokens, target=target)
        optimizer.step()
        optimizer.zero_grad()


def snapshot(pipe: Any, optimizer: Any) -> dict[str, dict[str, Any]]:
    """This process's parameters and optimizer state by FQN (the optimizer's last step validated)."""
    optimizer.finish()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    flat = get_optimizer_state_dict(pipe.module, optimizer.optimizer, options=options)
    return {
        "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
        "optimizer": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()},
    }


def save_resume_and_die_saving(directory: str) -> dict:
    """Run A: SAVED_AT steps (default schedule, costs measured), checkpoint "a", RESUMED more
    steps. Run B (another init, 1F1B) loads "a" and runs the same RESUMED steps; run C (another
    cut) loads it. Results go to `directory/rank<r>.pt`; then rank 1 is killed while writing
    checkpoint "b", and rank 0 returns the error it got."""
    rank = dist.get_rank()
    pipe, opt = make_run(0)
    train(pipe, opt, 0, SAVED_AT)
    in_use = make_schedule("zb-h1", 2, 4)  # as if measured costs had re-solved zb-auto's schedule
    pipe.runner.reschedule(in_use)
    measured = {"measured": pipe.compiled.schedule_costs(), "predicted_span": 1.0, "resolves": 1, "drift_resolves": 0}
    pipe.tuner.load_state_dict({**measured, "history": [{"step": 1, "event": "switched"}]})
    checkpoint.save(os.path.join(directory, "a"), pipe, opt, next_step=SAVED_AT, note=f"saved by rank {rank}")
    result = {"saved": snapshot(pipe, opt), "saved_tuner": pipe.tuner.state_dict()}
    train(pipe, opt, SAVED_AT, RESUMED)
    result["uninterrupted"] = snapshot(pipe, opt)

    torch.manual_seed(99)  # a process whose RNG went elsewhere meanwhile
    b_pipe, b_opt = make_run(1, schedule="1f1b")
    result["b_extra"] = checkpoint.load(os.path.join(directory, "a"), b_pipe, b_opt)
    result["b_step_count"] = b_pipe.step_count
    result["b_loaded"] = snapshot(b_pipe, b_opt)
    train(b_pipe, b_opt, SAVED_AT, RESUMED)
    result["b_resumed"] = snapshot(b_pipe, b_opt)

    c_pipe, c_opt = make_run(2, split_points=OTHER_CUT)
    checkpoint.load(os.path.join(directory, "a"), c_pipe, c_opt)
    result["c_loaded"] = snapshot(c_pipe, c_opt)
    result["c_schedule"] = c_pipe.schedule.name  # another cut: its own schedule

    d_pipe, d_opt = make_run(3)  # A's layout: the schedule in use and its tuner come back
    result["d_static_schedule"] = d_pipe.schedule.name
    checkpoint.load(os.path.join(directory, "a"), d_pipe)
    result["d_schedule_restored"] = d_pipe.schedule.actions == in_use.actions
    result["d_tuner"] = d_pipe.tuner.state_dict()
    torch.save(result, os.path.join(directory, f"rank{rank}.pt"))

    dist.barrier()
    if rank == 1:  # dies in the middle of writing its part of checkpoint "b"
        writer = torch.distributed.checkpoint.FileSystemWriter
        writer.write_data = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    try:
        checkpoint.save(os.path.join(directory, "b"), pipe, opt, next_step=SAVED_AT + RESUMED)
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def load_on_four(directory: str) -> dict:
    """Load checkpoint "a" (saved at 2 ranks) into a pipeline of 4 stages on 4 ranks, its model
    built on the meta device; then one step (every tensor a rank uses was filled)."""
    pipe, opt = make_run(3, stages=4, meta=True, schedule="1f1b")
    extra = checkpoint.load(os.path.join(directory, "a"), pipe, opt)
    result = {"loaded": snapshot(pipe, opt), "extra": extra, "step_count": pipe.step_count}
    train(pipe, opt, SAVED_AT, 1)
    opt.close()  # validates the step; its last messages have left before the process group goes
    return result


# --- pp=2 x dp=2: checkpoints across data_parallel="replicate" and "shard" ------------------------

# (saved under, loaded under): "shard" loads what either mode saved, "replicate" what "shard" saved
DP_LOADS = (("replicate", "shard"), ("shard", "shard"), ("shard", "replicate"))


def replica_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's half of `batch(step)` (2-rank pipelines over the world)."""
    replicas, replica = replica_of(2)
    return tuple(share(t, replicas, replica) for t in batch(step))


def make_dp_run(seed: int, data_parallel: str) -> tuple[Any, Any]:
    """As `make_run`, at 2 stages over every rank (pp=2 x dp=world/2) with `data_parallel`,
    compiled for this replica's half of the batch."""
    torch.manual_seed(seed)
    pipe = zbcompile.pipeline(
        GPT(CONFIG),
        stages=2,
        microbatches=4,
        loss_fn=lm_loss,
        timeout=60,
        solver_time_budget=0,
        data_parallel=data_parallel,
        # one fixed schedule, so that both modes hold the same stages on the same ranks (zb-auto
        # counts each mode's reduction and may place the stages differently)
        schedule="zb-h1",
    )
    tokens, target = replica_batch(0)
    pipe.compile(tokens, target=target)
    inner = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    return pipe, zbcompile.PostValidatedOptimizer(inner, pipe, max_norm=0.5)


def whole_snapshot(pipe: Any, optimizer: Any) -> dict[str, dict[str, Any]]:
    """`snapshot` with every DTensor gathered whole (a collective over the replicas)."""
    taken = snapshot(pipe, optimizer)
    return {
        part: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in values.items()}
        for part, values in taken.items()
    }


def dp_checkpoints() -> dict:
    """At pp=2 x dp=2, one run per mode (initialised alike): SAVED_AT steps, a checkpoint, its
    state then, and after RESUMED more steps uninterrupted. Then per `DP_LOADS` entry, the
    loading mode's run (moved on since its own save, its RNG elsewhere) loads the checkpoint and
    runs the same RESUMED steps. Whole parameters and optimizer state by FQN; the checkpoints
    live in a temporary directory removed after."""
    shared = [tempfile.mkdtemp(prefix="zb-dp-checkpoints-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    directory = shared[0]
    result: dict[Any, Any] = {}
    runs = {}
    try:
        for mode in ("replicate", "shard"):
            pipe, opt = runs[mode] = make_dp_run(0, mode)
            train(pipe, opt, 0, SAVED_AT, replica_batch)
            checkpoint.save(os.path.join(directory, mode), pipe, opt, next_step=SAVED_AT)
            result[(mode, "saved")] = whole_snapshot(pipe, opt)
            train(pipe, opt, SAVED_AT, RESUMED, replica_batch)
            result[(mode, "uninterrupted")] = whole_snapshot(pipe, opt)
        for saved, loading in DP_LOADS:
            pipe, opt = runs[loading]
            torch.manual_seed(99)
            result[(saved, loading, "extra")] = checkpoint.load(os.path.join(directory, saved), pipe, opt)
            result[(saved, loading, "dtensors")] = sum(isinstance(p, DTensor) for p in pipe.parameters())
            result[(saved, loading, "loaded")] = whole_snapshot(pipe, opt)
            train(pipe, opt, SAVED_AT, RESUMED, replica_batch)
            result[(saved, loading, "resumed")] = whole_snapshot(pipe, opt)
    finally:
        for _, opt in runs.values():
            opt.close()  # validates the last step; its messages leave before the process group goes
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return result
