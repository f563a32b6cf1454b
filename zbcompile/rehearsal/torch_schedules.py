"""torch.distributed.pipelining's schedules under a rehearsal's emulated times (`rehearsal/rehearse.py`),
for a comparison in the same run: each chunk is a module whose forward lasts the chunk's F, whose
input-gradient path (what torch's `stage_backward_input` runs) sleeps I, and whose weight path
(what `stage_backward_weight` runs from the saved intermediates) sleeps W; a fused backward runs
both. Every activation and gradient carries its sender's `time.perf_counter()` in one extra
column, and the receiving side waits until that time plus the link time, as our runtime's
`EmulatedLink` does.

torch's own choices stay as they are: its first stage has no input gradient to compute, so its
zero-bubble schedules run that stage's whole backward in W (`stage.backward_weight_one_chunk`),
I and W sleeping there together."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zbcompile.measure import sleep_until
from zbcompile.schedules.costs import ResolvedCosts

MULTI_CHUNK = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", *sorted(MULTI_CHUNK))  # those a rehearsal runs


class _Pause(torch.autograd.Function):
    """Identity forward; its backward sleeps `seconds` (the emulated I or W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class _Stamped(torch.autograd.Function):
    """Between chunks: forward appends the send time as one column; backward waits for the
    gradient's stamp plus `link_s`, then drops the column (the activation's way back)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, link_s: float) -> torch.Tensor:
        ctx.link_s = link_s
        return torch.cat([y, y.new_full((*y.shape[:-1], 1), time.perf_counter())], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _wait_link(grad, ctx.link_s)
        return grad[..., :-1], None


class _Arrived(torch.autograd.Function):
    """At a chunk's input: forward waits for the activation's stamp plus `link_s` and drops the
    column; backward stamps the input gradient with its send time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, link_s: float) -> torch.Tensor:
        _wait_link(x, link_s)
        return x[..., :-1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat([grad, grad.new_full((*grad.shape[:-1], 1), time.perf_counter())], dim=-1), None


def _wait_link(stamped: torch.Tensor, link_s: float) -> None:
    """Wait until the stamp in `stamped`'s last column plus `link_s`, never longer than `link_s`
    (torch's first step infers shapes on uninitialised tensors: their stamps mean nothing)."""
    left = min(float(stamped[..., -1].max()) + link_s - time.perf_counter(), link_s)
    if left > 0:
        time.sleep(left)


class EmulatedChunk(nn.Module):
    """One chunk: x @ a (no pause) -> the I pause -> @ b (its weight behind the W pause), so the
    input path passes the I pause and b's gradient the W pause; the first chunk, with an input
    that needs no gradient, still passes the I pause on its way to a's gradient."""

    def __init__(self, width: int, f_s: float, i_s: float, w_s: float, link_s: float, last: bool) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.b = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.f_s, self.i_s, self.w_s, self.link_s, self.last = f_s, i_s, w_s, link_s, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Arrived.apply(x, self.link_s)
        started = time.perf_counter()
        h = _Pause.apply(torch.tanh(x @ self.a), self.i_s)
        y = torch.tanh(h @ _Pause.apply(self.b, self.w_s))
        sleep_until(started + self.f_s)
        return y if self.last else _Stamped.apply(y, self.link_s)


def chunk_ranks(name: str, chunks: int, ranks: int) -> list[int]:
    """Rank of each chunk: one per rank; a loop for interleaved; a V for ZBV and DualPipeV."""
    if name not in MULTI_CHUNK:
        return list(range(ranks))
    if name in V_SHAPED:
        return [c if c < ranks else chunks - 1 - c for c in range(chunks)]
    return [c % ranks for c in range(chunks)]


class TorchRun:
    """torch's schedule `name` on this rank (of a pipeline of `per_stage.stages` ranks) over
    `microbatches` rows of `width`, each action taking `per_stage`'s time in units of `unit_s`
    seconds (chunks of a multi-chunk schedule take their share)."""

    def __init__(self, name: str, per_stage: ResolvedCosts, unit_s: float, microbatches: int, width: int) -> None:
        from torch.distributed import pipelining

        ranks, rank = per_stage.stages, dist.get_rank()
        chunks = 2 * ranks if name in MULTI_CHUNK else ranks
        costs = per_stage if chunks == ranks else per_stage.chunked(chunks // ranks)
        owner = chunk_ranks(name, chunks, ranks)
        mine = [c for c in range(chunks) if owner[c] == rank]
        torch.manual_seed(0)
        f, i, w, link = (tuple(t * unit_s for t in times) for times in (costs.f, costs.i, costs.w, (costs.comm,)))
        modules = {c: EmulatedChunk(width, f[c], i[c], w[c], link[0], c == chunks - 1) for c in mine}
        stages = [pipelining.PipelineStage(modules[c], c, chunks, torch.device("cpu")) for c in mine]
        schedule_class = getattr(pipelining, name)
        self.schedule = schedule_class(stages if name in MULTI_CHUNK else stages[0], microbatches, loss_fn=mse)
        self.has_first, self.has_last = 0 in mine, chunks - 1 in mine
        generator = torch.Generator().manual_seed(0)
        m = microbatches
        self.inputs = torch.cat([torch.randn(m, width, generator=generator), torch.zeros(m, 1)], dim=-1)
        self.targets = torch.randn(m, width, generator=generator)

    def step(self) -> None:
        torch_step(self.schedule, self.inputs, self.targets, self.has_first, self.has_last)


def torch_step(schedule: Any, inputs: Any, targets: Any, has_first: bool, has_last: bool) -> None:
    """One step of torch's `schedule` on this rank: the inputs where it holds the first stage, the
    targets where it holds the last."""
    args = (inputs,) if has_first else ()
    if has_last:
        schedule.step(*args, target=targets, losses=[], return_outputs=False)
    else:
        schedule.step(*args, return_outputs=False)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The stand-ins' loss, ours and torch's."""
    return ((output - target) ** 2).mean()
