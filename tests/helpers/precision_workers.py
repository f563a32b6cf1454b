"""Mixed-precision models and what each rank runs in the mixed-precision tests (importable by
spawned processes).

Two Llama-style models (transformers' Llama from the tiny config of `real_models`): "autocast",
the fp32 model whose forward runs under `torch.autocast("cpu", dtype=torch.bfloat16)`, and
"bf16", the model cast to bfloat16. `eager_microbatches` is the reference a pipelined step is
compared with: an eager loop over the microbatches, `(loss / m).backward()` each."""

from __future__ import annotations

import contextlib
import statistics
from typing import Any
from unittest import mock

import torch
from torch import nn

import zbcompile
from helpers.models import build as build_zoo
from helpers.post_validation_workers import train_case
from helpers.real_models import MICROBATCHES, build
from zbcompile.schedules.registry import SCHEDULE_NAMES, schedule_spec

MODES = ("autocast", "bf16")


class Autocast(nn.Module):
    """`model`'s forward under `torch.autocast(device_type="cpu", dtype=torch.bfloat16)`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def llama(mode: str):
    """The Llama case (model, batch) in `mode` ("autocast" or "bf16")."""
    case = build("llama")
    case.model = Autocast(case.model) if mode == "autocast" else case.model.to(torch.bfloat16)
    return case


def eager_microbatches(
    case, microbatches: int = MICROBATCHES, grad_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, dict]:
    """Mean loss and gradients of an eager loop over the microbatches (on `case.model` itself),
    each parameter's gradient accumulated in `grad_dtype` (torch's `param.grad_dtype`) when given.
    transformers chooses its attention-mask code by `torch.compiler.is_compiling()` and
    `is_exporting()`, which answer True and False while torch.compile (and our trace) runs: the
    reference patches both public functions to answer so, independently of zbcompile's own means,
    so it takes the same library path."""
    if grad_dtype is not None:
        for p in case.model.parameters():
            p.grad_dtype = grad_dtype
    chunks = [
        [t.chunk(microbatches) if isinstance(t, torch.Tensor) else [t] * microbatches for t in values]
        for values in (case.args, list(case.kwargs.values()))
    ]
    losses = []
    with _as_if_compiling():
        for k in range(microbatches):
            args = [c[k] for c in chunks[0]]
            kwargs = dict(zip(case.kwargs, [c[k] for c in chunks[1]]))
            loss = case.model(*args, **kwargs).loss
            (loss / microbatches).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in case.model.named_parameters()}


def _as_if_compiling() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for name, answer in (("is_compiling", True), ("is_exporting", False)):
        stack.enter_context(mock.patch.object(torch.compiler, name, lambda answer=answer: answer))
    return stack


def _layouts() -> list[tuple[int, list[str]]]:
    """Every schedule, grouped by how it places stages on 2 ranks (one compile each): the stage
    count (2 per chunk of a rank), the placement and whether a mirrored copy runs beside it."""
    groups: dict[tuple, list[str]] = {}
    for name in SCHEDULE_NAMES:
        spec = schedule_spec(name)
        groups.setdefault((2 * spec.chunks_per_rank, spec.placement, spec.mirrored), []).append(name)
    return [(stages, names) for (stages, _, _), names in groups.items()]


def train_all_schedules() -> dict:
    """On 2 ranks: for each mode, one step per schedule (one compile per stage count); the bf16
    model with `grad_dtype=torch.float32`; post-validated AdamW on the bf16 GPT against the
    synchronous barrier (the max norm is the median norm of an unclipped run, so some steps clip).
    Returns the losses (None off the last stage) and this rank's gradients."""
    results: dict = {}
    for mode in MODES:
        for stages, names in _layouts():
            case = llama(mode)
            pipe = zbcompile.pipeline(
                case.model,
                stages=stages,
                microbatches=MICROBATCHES,
                schedule=names[0],
                profile=False,
                solver_time_budget=0.5,
                timeout=60,
            )
            for name in names:
                pipe.set_schedule(name)
                pipe.zero_grad()
                loss = case.step(pipe)
                results[(mode, name)] = {"loss": loss, "grads": _own_grads(pipe)}
    case = llama("bf16")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=MICROBATCHES, schedule="zb-h1", grad_dtype=torch.float32, timeout=60
    )
    results["grad_dtype"] = {"loss": case.step(pipe), "grads": _own_grads(pipe)}
    results["post_validation"] = _post_validation_bf16()
    return results


def _own_grads(pipe) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _post_validation_bf16() -> dict:
    gpt = build_zoo("gpt", dtype=torch.bfloat16)
    pipe = zbcompile.pipeline(gpt.model, stages=2, microbatches=4, loss_fn=gpt.loss_fn, schedule="zb-h1", timeout=60)
    pipe.step(*gpt.args, target=gpt.target)
    initial = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    unclipped = train_case(pipe, initial, "adamw", "sync", None, None)
    max_norm = statistics.median(norm for norm, _, _ in unclipped["history"])
    return {mode: train_case(pipe, initial, "adamw", mode, max_norm, None) for mode in ("exact", "sync")}
