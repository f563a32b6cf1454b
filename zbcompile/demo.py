"""`zbcompile demo`: train a small GPT on the text shipped with the package as a 4-rank pipeline
(local processes; gloo on CPU, NCCL when there are enough GPUs) with the zb-auto schedule solved
from measured costs, then the same run with 1F1B, and compare measured step time and bubble.

Each rank is a process launched here; `examples/train_gpt.py` shows the same under torchrun."""

from __future__ import annotations

import argparse
import importlib.resources
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zbcompile
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import Action, render, schedule_spec


def text_batches(batch: int, seq_len: int, seed: int = 0):
    """Endless random windows of the bundled text as (tokens, next tokens), bytes as tokens."""
    data = importlib.resources.files("zbcompile").joinpath("data/tiny.txt").read_bytes()
    tokens = torch.tensor(list(data), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(args: argparse.Namespace, schedule: str, device: torch.device, show: bool) -> dict:
    """Train for args.steps steps; returns per-step times and the last step's timelines."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, hidden=args.hidden, heads=4, layers=args.layers)
    with torch.device("meta"):
        model = GPT(config)
    pipe = zbcompile.pipeline(
        model, stages=args.stages, microbatches=args.microbatches, loss_fn=lm_loss, schedule=schedule,
        profile=schedule_spec(schedule).solved, solver_time_budget=args.solver_budget, timeout=120,
        dump_dir=os.path.join(args.dump, schedule),
    )
    batches = text_batches(args.batch, args.seq_len)
    tokens, targets = next(batches)
    pipe.compile(tokens.to(device), target=targets.to(device))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    progress = _progress(args.steps, f"{schedule:>7s}") if show else None
    times, loss = [], None
    for _ in range(args.steps):
        tokens, targets = next(batches)
        started = time.perf_counter()
        optimizer.zero_grad()
        step_loss = pipe.step(tokens.to(device), target=targets.to(device))
        optimizer.step()
        times.append(time.perf_counter() - started)
        loss = step_loss if step_loss is not None else loss
        if progress is not None:
            progress.set_postfix(loss=f"{loss.item():.3f}", tokens_s=f"{tokens.numel() / times[-1]:,.0f}")
            progress.update()
    if progress is not None:
        progress.close()
    timelines: list = [None] * dist.get_world_size()
    dist.all_gather_object(timelines, pipe.runner.timeline)
    return {"times": times, "timelines": timelines, "loss": None if loss is None else loss.item(), "schedule": pipe.schedule}


def _progress(total: int, name: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="step")


def measured_bubble(timelines: list, ranks: int) -> tuple[float, float]:
    """(step time, bubble rate) of one measured step: 1 - busy / (ranks x step time)."""
    spans = [(min(s for _, s, _ in t), max(e for _, _, e in t)) for t in timelines if t]
    step = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = sum(e - s for t in timelines for _, s, e in t)
    return step, 1 - busy / (ranks * step)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    try:
        results = {}
        for schedule in ("zb-auto", "1f1b"):
            results[schedule] = train(args, schedule, device, show=rank == world - 1)
        if rank == world - 1:  # the last stage's rank has the loss
            _report(args, results, out_dir, "nccl" if use_cuda else "gloo")
    finally:
        dist.destroy_process_group()


def _report(args: argparse.Namespace, results: dict, out_dir: str, backend: str) -> None:
    print(f"\n{args.stages}-rank pipeline ({backend}), {args.microbatches} microbatches, {args.steps} steps each")
    print(f"{'schedule':>9s}  {'median step':>11s}  {'measured bubble':>15s}  {'final loss':>10s}")
    medians = {}
    for name, result in results.items():
        steady = result["times"][min(3, len(result["times"]) - 1) :]
        medians[name] = statistics.median(steady)
        _, bubble = measured_bubble(result["timelines"], args.stages)
        print(f"{name:>9s}  {medians[name] * 1000:9.1f} ms  {bubble:15.1%}  {result['loss']:10.4f}")
    print(f"zb-auto / 1f1b step time: {medians['zb-auto'] / medians['1f1b']:.3f} (same losses: every schedule computes the same gradients)")
    print("\nzb-auto schedule (solved from measured costs):")
    print(results["zb-auto"]["schedule"].grid())
    timelines = results["zb-auto"]["timelines"]
    origin = min(start for timeline in timelines for _, start, _ in timeline)
    boxes = []
    for rank, timeline in enumerate(timelines):
        for text, start, end in timeline:
            action = Action.parse(text)
            boxes.append(render.Box(rank, (start - origin) * 1e3, (end - origin) * 1e3, str(action.microbatch), action.kind, text))
    path = os.path.join(out_dir, "zb-auto-measured.svg")
    with open(path, "w") as f:
        f.write(render.to_svg(boxes, title="zb-auto: one measured step (ms)"))
    print(f"\nmeasured timeline of the last zb-auto step: {path}")
    from zbcompile import inspection, report

    dump = inspection.load(os.path.join(args.dump, "zb-auto"))
    page = report.write_report(dump, os.path.join(out_dir, "report.html"))
    found = inspection.comparison(dump.versions[-1], dump.trace)
    if found is not None:
        print(f"zb-auto measured / predicted makespan: {found['ratio']:.2f} ({found['makespan'] * 1e3:.1f} / {found['predicted_makespan'] * 1e3:.1f} ms)")
    print(f"dumps (graphs, tables, schedules, trace.json for Perfetto): {args.dump}; summary: zbcompile inspect {dump.directory}")
    print(f"report: {page}")


def run(args: argparse.Namespace) -> int:
    out_dir = args.out or tempfile.mkdtemp(prefix="zbcompile-demo-")
    os.makedirs(out_dir, exist_ok=True)
    args.dump = os.path.join(out_dir, "dump")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(args.stages, port, args, out_dir), nprocs=args.stages, start_method="spawn")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="train a small GPT as a 4-rank zero-bubble pipeline")
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--solver-budget", type=float, default=2.0)
    parser.add_argument("--out", default="zbcompile_demo", help="where pictures and dumps go")
    parser.set_defaults(func=run)
