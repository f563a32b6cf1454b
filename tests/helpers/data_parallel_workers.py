"""What each rank runs in the data-parallel test: 4 ranks as 2 replicas x a 2-rank pipeline,
each replica given its own half of the batch (importable by spawned processes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zbcompile
from helpers import models, real_models
from helpers.distributed_workers import make_optimizer
from helpers.multiprocess import replica_of
from zbcompile.inspect.write import live_dump
from zbcompile.runtime.state.optimizer import PostValidatedOptimizer, SynchronousClipOptimizer

STEPS = 3
PP = 2
MICROBATCHES = 4  # one row each: the replica's half of the 8-row batch
# (model, schedule, stages, data_parallel, optimizer variant) of `train`, in order
RUNS = [
    *[("gpt", s, 2, "replicate", "foreach") for s in ("1f1b", "zb-h1", "zb-auto")],
    *[("gpt", s, 2, "shard", "foreach") for s in ("1f1b", "zb-h1", "zb-auto")],
    ("gpt", "zb-h1", 2, "shard", "fused"),
    # dualpipe: every parameter on two ranks of a pipeline, reduced after the drain; the masked
    # model's output layer has 3 rows, which 2 replicas do not divide (padded in the collectives)
    ("masked", "dualpipe", 2, "replicate", "foreach"),
    ("masked", "dualpipe", 2, "shard", "foreach"),
    *[("llama", s, 2, "replicate", "foreach") for s in ("zb-h1", "1f1b", "zb-auto")],
    *[("llama", s, 2, "shard", "foreach") for s in ("zb-h1", "1f1b", "zb-auto")],
    ("llama", "zbv", 4, "replicate", "foreach"),
    ("llama", "zbv", 4, "shard", "foreach"),
    ("gpt", "zbv", 4, "replicate", "foreach"),
    ("gpt", "zbv", 4, "shard", "foreach"),  # last: its pipeline goes through a checkpoint round trip
]


def case_of(name: str, meta: bool = False, dtype: torch.dtype = torch.float32):
    """The zoo's (in `dtype`) or the library's case `name`, with this replica's half of the batch."""
    case = real_models.build(name, meta=meta) if name in real_models.MODELS else models.build(name, dtype=dtype)
    replicas, replica = replica_of(PP)
    case.args = tuple(models.share(a, replicas, replica) for a in case.args)
    case.kwargs = {k: models.share(v, replicas, replica) for k, v in case.kwargs.items()}
    case.target = models.share(case.target, replicas, replica)
    return case


def whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), a tensor as it is; detached copies."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def train(runs: list[tuple[str, str, int, str, str]], directory: str) -> dict:
    """For each (model, schedule, stages, data_parallel, optimizer variant: "foreach" or
    "fused"): `STEPS` AdamW steps on this replica's half of the batch. Consecutive runs of one
    (model, stages, data_parallel) share a compile, reloading the initial state dict. Returns
    per run the losses, the whole parameters and optimizer state by FQN, this rank's bytes of
    parameters, gradients and optimizer state, the last step's timelines and the state dict's
    kinds of value; per compile, under ("compiled", model, stages, data_parallel), the whole
    parameters it starts from (another replica's model is perturbed before it); the last run's
    pipeline dumps into `directory`/dump and goes through a checkpoint round trip in
    `directory`/dcp; then post-validation and errors."""
    results, pipe, previous = {}, None, None
    for name, schedule, stages, mode, variant in runs:
        initial = case_of(name).model.state_dict()
        if (name, stages, mode) != previous:
            case = case_of(name)
            if replica_of(PP)[1] != 0:  # the compile's broadcast must replace another replica's start
                with torch.no_grad():
                    for param in case.model.parameters():
                        param.add_(1.0)
            pipe = zbcompile.pipeline(
                case.model,
                stages=stages,
                microbatches=MICROBATCHES,
                loss_fn=case.loss_fn,
                schedule=schedule,
                timeout=120,
                solver_time_budget=0.2,
                data_parallel=mode,
                profile=False,
                dump_dir=os.path.join(directory, "dump")
                if (name, schedule, stages, mode, variant) == runs[-1]
                else None,
            )
            pipe.compile(*case.args, target=case.target, **case.kwargs)
            results[("compiled", name, stages, mode)] = {n: whole(p) for n, p in pipe.named_parameters()}
            previous = (name, stages, mode)
        else:
            pipe.set_schedule(schedule)
        pipe.load_state_dict(initial, strict=False)
        optimizer = make_optimizer("adamw", pipe.parameters()) if variant == "foreach" else torch.optim.AdamW(
            pipe.parameters(), lr=0.01, weight_decay=0.1, eps=1e-4, fused=True
        )
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            losses.append(case.step(pipe))
            optimizer.step()
        names = {p: n for n, p in pipe.named_parameters()}
        results[(name, schedule, stages, mode, variant)] = {
            "losses": losses,
            "params": {n: whole(p) for n, p in pipe.named_parameters()},
            "optimizer": {names[p]: {k: whole(v) for k, v in s.items()} for p, s in optimizer.state.items()},
            "bytes": {
                "params": local_bytes(pipe.parameters()),
                "grads": local_bytes(p.grad for p in pipe.parameters() if p.grad is not None),
                "optimizer": local_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim()),
            },
            "dtensor": {n: isinstance(p, DTensor) for n, p in pipe.named_parameters()},
            "local_rows": {n: p.to_local().shape[0] for n, p in pipe.named_parameters() if isinstance(p, DTensor)},
            "state_dict": {k: type(v).__name__ for k, v in pipe.state_dict().items()},
            "timeline": list(pipe.runner.timeline),
            "comm_timeline": list(pipe.runner.comm_timeline),
            "explain": pipe.explain(),
            "state_rows": live_dump(pipe).record["world"]["state_bytes"][pipe.runner.layout.pp_rank],
            "reduction": pipe.schedule.info.get("reduction"),
        }
    results["checkpoint"] = checkpoint_round_trip(pipe, os.path.join(directory, "dcp"))
    results["post_validation"] = post_validation()
    results["grad_dtype"] = grad_dtype_runs()
    results["errors"] = errors()
    return results


def grad_dtype_runs() -> dict:
    """The bf16 GPT under zb-h1 with `grad_dtype=torch.float32`, "replicate" and "shard": one
    step on this replica's half of the batch; this rank's whole gradients by FQN."""
    result = {}
    for mode in ("replicate", "shard"):
        case = case_of("gpt", dtype=torch.bfloat16)
        pipe = zbcompile.pipeline(
            case.model, stages=PP, microbatches=MICROBATCHES, loss_fn=case.loss_fn, schedule="zb-h1", timeout=120,
            data_parallel=mode, grad_dtype=torch.float32, profile=False,
        )
        case.step(pipe)
        result[mode] = {
            "grads": {n: whole(p.grad) for n, p in pipe.named_parameters() if p.grad is not None},
            "param_dtypes": {p.dtype for p in pipe.parameters()},
            "grad_types": {type(p.grad).__name__ for p in pipe.parameters() if p.grad is not None},
        }
    return result


def checkpoint_round_trip(pipe, path: str) -> dict:
    """torch.distributed.checkpoint saves `pipe`'s state dict (DTensors under "shard") to `path`,
    the parameters are zeroed, and DCP loads it back: whether every parameter is as saved."""
    import torch.distributed.checkpoint as dcp

    saved = {n: whole(p) for n, p in pipe.named_parameters()}
    dcp.save(pipe.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=path)
    pipe.load_state_dict(state, strict=False)
    return {n: torch.equal(whole(p), saved[n]) for n, p in pipe.named_parameters()}


def post_validation(steps: int = 5, fault_step: int = 2) -> dict:
    """The GPT under zb-h1 with data_parallel="shard": 5 AdamW steps clipped at max_norm 0.5,
    an Inf in pipeline rank 0's first gradient at `fault_step`, post-validated ("exact") and
    synchronously; this rank's whole parameters and optimizer state after each."""
    case = case_of("gpt")
    pipe = zbcompile.pipeline(
        case.model,
        stages=PP,
        microbatches=MICROBATCHES,
        loss_fn=case.loss_fn,
        schedule="zb-h1",
        timeout=120,
        data_parallel="shard",
        profile=False,
    )
    pipe.compile(*case.args, target=case.target)
    initial = models.build("gpt").model.state_dict()
    result = {}
    for label, wrap in (
        ("post", lambda o: PostValidatedOptimizer(o, pipe, max_norm=0.5)),
        ("sync", lambda o: SynchronousClipOptimizer(o, pipe, max_norm=0.5)),
    ):
        pipe.load_state_dict(initial, strict=False)
        pipe.zero_grad()
        optimizer = wrap(make_optimizer("adamw", pipe.parameters()))
        for step in range(steps):
            case.step(pipe)
            if step == fault_step and pipe.runner.layout.pp_rank == 0:
                grad = next(p.grad for p in pipe.parameters() if p.grad is not None)
                grad.to_local().view(-1)[0] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        optimizer.finish()
        names = {p: n for n, p in pipe.named_parameters()}
        result[label] = {
            "params": {n: whole(p) for n, p in pipe.named_parameters()},
            "optimizer": {names[p]: {k: whole(v) for k, v in s.items()} for p, s in optimizer.state.items()},
            "history": [(r.total_norm, r.clipped, r.skipped) for r in optimizer.history],
        }
        if label == "post":
            optimizer.close()
    return result


class _Scaled(nn.Module):
    """Two linear layers and a scalar parameter, which "shard" cannot cut along a first dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) * self.scale


def errors() -> dict:
    """Each mistake's error message on this rank: data_parallel="shard" without replicas (a
    process group of one pipeline), an unknown data_parallel mode, a world that pipelines of 3
    ranks do not divide, a scalar parameter under "shard", and replica 1 passing twice the rows
    replica 0 passes."""
    result = {}
    group = dist.new_group(
        list(range(dist.get_rank() // PP * PP, dist.get_rank() // PP * PP + PP)), use_local_synchronization=True
    )
    uneven = case_of("mlp")
    if replica_of(PP)[1] == 1:
        uneven.args = tuple(torch.cat([a, a]) for a in uneven.args)
        uneven.target = torch.cat([uneven.target, uneven.target])
    scaled = models.Case("scaled", _Scaled(), (torch.randn(4, 4),), {}, torch.randn(4, 4), torch.nn.functional.mse_loss)
    mistakes = (
        ("no replicas", case_of("mlp"), dict(process_group=group, data_parallel="shard")),
        ("unknown", case_of("mlp"), dict(data_parallel="fsdp")),
        ("world", case_of("mlp"), dict(stages=3)),
        ("scalar", scaled, dict(data_parallel="shard")),
        ("batch sizes", uneven, dict(schedule="zb-h1")),
    )
    for label, case, kwargs in mistakes:
        options = dict(stages=PP, microbatches=2, loss_fn=case.loss_fn, timeout=60, profile=False) | kwargs
        try:
            pipe = zbcompile.pipeline(case.model, **options)
            case.step(pipe)
            result[label] = "no error"
        except (ValueError, TypeError) as error:
            result[label] = f"{type(error).__name__}: {error}"
    return result
