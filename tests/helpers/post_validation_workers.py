"""What each rank runs in the post-validation tests (importable by spawned processes).

One pipeline per (stages, layout); on it, every case trains `STEPS` steps from the same start
(the parameters are reset in place, the optimizer is new). Cases differ by optimizer, by how
the clip/skip is done (post-validated "exact"/"reverse", the synchronous all-gather "sync", or
"torch": the whole pipeline's gradients gathered and clipped with torch.nn.utils), and by an
optional Inf injected into one rank's gradients at one step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import zbcompile
from helpers.models import BATCH, GPT_CONFIG, build, share
from helpers.multiprocess import replica_of
from zbcompile.runtime.state.optimizer import (
    PostValidatedOptimizer,
    StepRecord,
    SynchronousClipOptimizer,
)

STEPS = 10
FAULT_STEP = 4
MICROBATCHES = 4
# about the median of the step norms of these runs without clipping, so that some steps clip
# and some do not (the tests check that both happen)
MAX_NORM = {"sgd": 0.59, "adam": 0.51, "adamw": 0.53}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.01, eps=1e-4)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-4)


def batches(replicas: int = 1, replica: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per step: data-parallel replica `replica`'s share (of `replicas`) of the same
    global batches."""
    generator = torch.Generator().manual_seed(1234)
    shape = (BATCH, GPT_CONFIG.seq_len)
    return [
        tuple(
            share(torch.randint(0, GPT_CONFIG.vocab_size, shape, generator=generator), replicas, replica)
            for _ in range(2)
        )
        for _ in range(STEPS)
    ]


class TorchClipReference:
    """Synchronous reference built on torch.nn.utils: every gradient of the pipeline (a tied
    weight once) gathered on every rank, total norm by `get_total_norm`, this rank's gradients
    clipped by `clip_grads_with_norm_`, then the step (skipped when the norm is not finite)."""

    def __init__(self, optimizer: torch.optim.Optimizer, pipe, max_norm: float | None) -> None:
        self.optimizer, self.pipe, self.max_norm = optimizer, pipe, max_norm
        self.history: list[StepRecord] = []
        runner = pipe.runner
        self.group = runner.layout.pp_group
        foreign = {t.fqn for t in runner.tied_weights if t.owner != runner.rank}
        self.counted = [p for n, p in pipe.named_parameters() if n not in foreign]

    def step(self) -> None:
        mine = [p.grad for p in self.counted if p.grad is not None]
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        total = torch.nn.utils.get_total_norm([g for grads in gathered for g in grads], 2.0)
        self.history.append(StepRecord(total.item(), False, not torch.isfinite(total).item()))
        if not torch.isfinite(total):
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, total)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def finish(self) -> None:
        pass

    close = finish


def _snapshot(pipe, optimizer: torch.optim.Optimizer) -> dict:
    params = dict(pipe.named_parameters())
    names = {p: n for n, p in params.items()}
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "state": {
            names[p]: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for p, s in optimizer.state.items()
        },
    }


def _refusals(pipe, opt) -> list[str]:
    """What `state_dict()` of the optimizer and of the pipe say while a step may be unvalidated."""
    said = []
    for call in (opt.state_dict, pipe.state_dict):
        try:
            call()
            said.append("returned")
        except RuntimeError as error:
            said.append(str(error))
    return said


def train_case(
    pipe, initial: dict, optimizer_name: str, mode: str, max_norm: float | None, fault_rank: int | None
) -> dict:
    """`STEPS` steps from `initial`; with `fault_rank`, an Inf in this pipeline rank's first
    gradient at `FAULT_STEP` (the validated state before and after that step is recorded)."""
    with torch.no_grad():
        for n, p in pipe.named_parameters():
            p.copy_(initial[n])
    pipe.zero_grad()
    inner = make_optimizer(optimizer_name, pipe.parameters())
    if mode in ("exact", "reverse"):
        opt = PostValidatedOptimizer(inner, pipe, max_norm=max_norm, rollback=mode)
    elif mode == "sync":
        opt = SynchronousClipOptimizer(inner, pipe, max_norm=max_norm, skip_nonfinite=True)
    else:
        opt = TorchClipReference(inner, pipe, max_norm)
    around_fault = []
    for step, (tokens, target) in enumerate(batches(*replica_of(pipe.runner.layout.pp_size))):
        pipe.step(tokens, target=target)
        if fault_rank is not None and step == FAULT_STEP and pipe.runner.layout.pp_rank == fault_rank:
            grad = next(p.grad for p in pipe.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        opt.step()
        if step == 0 and mode == "exact":
            result_refusals = _refusals(pipe, opt)
        opt.zero_grad()
        if fault_rank is not None and step in (FAULT_STEP - 1, FAULT_STEP):
            opt.finish()
            around_fault.append(_snapshot(pipe, inner))
    opt.close()
    result = _snapshot(pipe, inner)
    result["around_fault"] = around_fault
    result["refusals"] = result_refusals if mode == "exact" else None
    result["history"] = [(r.total_norm, r.clipped, r.skipped) for r in getattr(opt, "history", [])]
    result["rollbacks"] = getattr(opt, "rollbacks", 0)
    return result


def train_all(pipelines: list[tuple[int, tuple[str, ...]]]) -> dict:
    """For each (stages, optimizers): a GPT pipeline (zb-h1, world // stages data-parallel
    replicas) and, per optimizer, the cases above (reverse with a fault for AdamW only)."""
    results = {}
    for stages, optimizers in pipelines:
        started = time.perf_counter()
        case = build("gpt")
        pipe = zbcompile.pipeline(
            case.model, stages=stages, microbatches=MICROBATCHES, loss_fn=case.loss_fn, schedule="zb-h1", timeout=60
        )
        tokens, target = batches(*replica_of(stages))[0]
        pipe.compile(tokens, target=target)
        initial = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        fault_rank = stages // 2 - 1
        for name in optimizers:
            runs = [(m, False) for m in ("sync", "torch", "exact", "reverse")] + [("sync", True), ("exact", True)]
            for mode, fault in runs + ([("reverse", True)] if name == "adamw" else []):
                results[(stages, name, mode, fault)] = train_case(
                    pipe, initial, name, mode, MAX_NORM[name], fault_rank if fault else None
                )
        results[(stages, "layout")] = {
            "pp_rank": pipe.runner.layout.pp_rank,
            "dp_rank": pipe.runner.layout.dp_rank,
            "tied_owner": [t.owner for t in pipe.runner.tied_weights],
            "seconds": time.perf_counter() - started,
        }
    return results
