"""The CUDA path checked on a real GPU: a pipeline's loss and gradients against an eager loop
over the microbatches (fp32, TF32 off: rtol 1e-5, atol 1e-6), for every single- and two-chunk
schedule, with `torch.cuda.synchronize` made to raise inside `pipe.step` (the runtime never
calls it in a step), and the per-action times that CUDA events measured.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_check.py   # NCCL, one GPU per rank
    python benchmarks/gpu_check.py                                     # one process on cuda:0

NCCL needs a GPU per rank (two ranks on one GPU are refused, by NCCL and by the pipeline's own
check), so on a machine with one GPU the script runs the pipeline in one process on that GPU.
Writes a JSON line per run to --out (default benchmarks/results/gpu_check.json) from rank 0."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zbcompile  # noqa: E402
from zbcompile.models import GPT, GPTConfig  # noqa: E402
from zbcompile.models.gpt import lm_loss as loss_fn  # noqa: E402
from zbcompile.schedules import schedule_spec  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto", "interleaved-1f1b", "zbv", "dualpipev")


def check(schedule: str, ranks: int, device: torch.device) -> dict:
    config = GPTConfig(layers=4, hidden=64, heads=4, seq_len=32)
    torch.manual_seed(0)
    eager = GPT(config).to(device)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    targets = torch.roll(tokens, -1, dims=1)
    chunks = schedule_spec(schedule).chunks_per_rank
    # zb-auto with the default compiler (Inductor stage programs on CUDA), the others op by op
    compiler = None if schedule == "zb-auto" else "eager"
    pipe = zbcompile.pipeline(
        model, stages=ranks * chunks, microbatches=4, loss_fn=loss_fn, schedule=schedule, timeout=120, profile=False,
        compiler=compiler,
    )
    pipe.step(tokens, target=targets)  # compile and warm up
    pipe.zero_grad()
    synchronize = torch.cuda.synchronize

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize inside pipe.step")

    if device.type == "cuda":
        torch.cuda.synchronize = forbidden
    try:
        started = time.perf_counter()
        loss = pipe.step(tokens, target=targets)
        step_s = time.perf_counter() - started
    finally:
        torch.cuda.synchronize = synchronize
    reference = sum(loss_fn(eager(t), y) / 4 for t, y in zip(tokens.chunk(4), targets.chunk(4)))
    reference.backward()
    worst = 0.0
    for name, param in pipe.named_parameters():
        if param.grad is None:
            continue
        expected = dict(eager.named_parameters())[name].grad
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule} {name}: {m}")
        worst = max(worst, (param.grad - expected).abs().max().item())
    if loss is not None:
        torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=1e-6)
    times = {text: round((end - start) * 1e3, 4) for text, start, end in pipe.runner.timeline}
    return {"schedule": schedule, "ranks": ranks, "step_s": step_s, "max_abs_grad_diff": worst, "action_ms": times}


def rank_device_index(distributed: bool) -> int:
    """cuda:LOCAL_RANK under torchrun where there is such a GPU; else the current device (two ranks
    on one GPU then meet the pipeline's refusal, which this script checks for)."""
    local = int(os.environ.get("LOCAL_RANK", -1)) if distributed else -1
    return local if 0 <= local < torch.cuda.device_count() else torch.cuda.current_device()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_check.json")
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, every path but CUDA's")
    args = parser.parse_args()
    on_cpu = args.device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked")
        return
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo" if on_cpu else "nccl")  # the pipeline sets cuda:LOCAL_RANK itself
    ranks = dist.get_world_size() if distributed else 1
    device = torch.device("cpu") if on_cpu else torch.device("cuda", rank_device_index(distributed))
    rows = []
    for schedule in SCHEDULES if ranks > 1 else ("1f1b", "zb-h1", "zb-auto"):
        row = check(schedule, ranks, device)
        rows.append(row)
        if not distributed or dist.get_rank() == 0:
            print(
                f"{schedule}: gradients equal eager (max |diff| {row['max_abs_grad_diff']:.2e}), step "
                f"{row['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
    if not distributed or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        where = {
            "backend": dist.get_backend() if distributed else "one process",
            "device": "cpu" if on_cpu else torch.cuda.get_device_name(),
        }
        with open(args.out, "w") as f:
            f.writelines(json.dumps({**row, **where}) + "\n" for row in rows)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
