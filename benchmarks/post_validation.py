"""Global gradient clipping with and without the end-of-step barrier, measured side by side.

Two gloo ranks (one thread each) train the same GPT (untied embeddings, so that no tied-weight
all-reduce syncs the ranks at the end of a step) with zb-h1, alternating rounds of

  (a) sync: `SynchronousClipOptimizer`: the pipeline's ranks exchange their squared gradient
      norms (an all-gather: a barrier) before each optimizer step, then clip and step;
  (b) post-validated: `PostValidatedOptimizer(rollback="exact")`: partial norms travel last ->
      first rank, each rank steps at once, the global norm is validated during the next step.

Per round and variant: a barrier, `steps_per_round` training steps back to back (step, optimizer
step, zero_grad), the post-validated variant's `finish()`, a barrier; seconds per step. Both
use the same max_norm: by default 4x the median gradient norm of the warm-up steps, so that
clipping is as rare as in a healthy training run (each clip costs the post-validated variant an
optimizer step more on the ranks that stepped optimistically; `--max-norm-factor 0.5` makes
nearly every step clip). Printed:
medians, the throughput ratio, how many steps clipped and were rolled back, and the step-time
simulator's prediction for both (`zbcompile.schedules.steps`) from the per-action medians, the
measured optimizer-step time, all-gather latency and message latency.

    python benchmarks/post_validation.py           # ~2-3 minutes on 2 cores
    python benchmarks/post_validation.py --quick   # a smoke run

Writes benchmarks/results/post_validation.{json,md} (and the simulated timelines as SVG).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))

import _launch  # noqa: E402

VARIANTS = ("sync", "post-validated")


@dataclass(frozen=True)
class Settings:
    vocab: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    rows: int = 2  # sequences per microbatch
    microbatches: int = 8
    schedule: str = "zb-h1"
    warmup: int = 2
    rounds: int = 20
    steps_per_round: int = 3
    lr: float = 1e-3
    max_norm_factor: float = 4.0  # max_norm = this x the median gradient norm of the warm-up steps
    timeout_s: float = 300.0


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    import zbcompile
    from zbcompile.models import GPT, GPTConfig
    from zbcompile.models.gpt import lm_loss

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=settings.vocab, seq_len=settings.seq_len, hidden=settings.hidden, heads=settings.heads,
        layers=settings.layers, tie_embeddings=False,
    )
    model = GPT(config)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(
        0, settings.vocab, (settings.microbatches * settings.rows, settings.seq_len), generator=generator
    )
    targets = tokens.roll(-1, 1)
    pipe = zbcompile.pipeline(
        model,
        stages=2,
        microbatches=settings.microbatches,
        loss_fn=lm_loss,
        schedule=settings.schedule,
        timeout=settings.timeout_s,
    )
    pipe.compile(tokens, target=targets)

    # warm-up with the synchronous variant, which also measures the gradient norms
    probe = zbcompile.SynchronousClipOptimizer(torch.optim.AdamW(pipe.parameters(), lr=settings.lr), pipe)
    for _ in range(settings.warmup + 2):
        pipe.step(tokens, target=targets)
        probe.step()
        probe.zero_grad()
    max_norm = settings.max_norm_factor * statistics.median(r.total_norm for r in probe.history)
    optimizers = {
        "sync": zbcompile.SynchronousClipOptimizer(
            torch.optim.AdamW(pipe.parameters(), lr=settings.lr), pipe, max_norm=max_norm
        ),
        "post-validated": zbcompile.PostValidatedOptimizer(
            torch.optim.AdamW(pipe.parameters(), lr=settings.lr), pipe, max_norm=max_norm
        ),
    }

    def run(variant: str) -> tuple[float, list, list[float]]:
        opt = optimizers[variant]
        timelines, optimizer_s = [], []
        dist.barrier()
        started, own, busy = time.perf_counter(), time.process_time(), _launch.cpu_busy_seconds()
        for _ in range(settings.steps_per_round):
            pipe.step(tokens, target=targets)
            timelines.append(list(pipe.runner.timeline))
            t0 = time.perf_counter()
            opt.step()
            optimizer_s.append(time.perf_counter() - t0)
            opt.zero_grad()
        opt.finish()
        dist.barrier()
        wall = time.perf_counter() - started
        usage[variant].append((wall, time.process_time() - own, _launch.cpu_busy_seconds() - busy))
        return wall / settings.steps_per_round, timelines, optimizer_s

    usage: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for variant in VARIANTS:  # warm-up of each variant's code path
        run(variant)
    usage.clear()
    times: dict[str, list[float]] = defaultdict(list)
    timelines: dict[str, list] = defaultdict(list)
    optimizer_s: dict[str, list[float]] = defaultdict(list)
    for r in range(settings.rounds):
        for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            seconds, steps, opt_s = run(variant)
            times[variant].append(seconds)
            timelines[variant] += steps
            optimizer_s[variant] += opt_s
        if dist.get_rank() == 0:
            print(
                f"round {r + 1}/{settings.rounds}: "
                + ", ".join(f"{v} {1e3 * times[v][-1]:.1f} ms/step" for v in VARIANTS),
                flush=True,
            )
    optimizers["post-validated"].close()
    return {
        "times": dict(times),
        "usage": dict(usage),
        "timelines": dict(timelines),
        "optimizer_s": dict(optimizer_s),
        "latency": _latencies(dist, torch),
        "max_norm": max_norm,
        "history": {v: [(h.total_norm, h.clipped, h.skipped) for h in o.history] for v, o in optimizers.items()},
        "rollbacks": optimizers["post-validated"].rollbacks,
        "schedule": pipe.schedule,
        "local_stages": pipe.runner.local_stages,
    }


def _latencies(dist, torch, repeats: int = 50) -> dict[str, float]:
    """Median seconds of one small message (half a ping-pong) and of a 2-rank all-gather of the
    2-element norm state."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    value = torch.zeros(2, dtype=torch.float64)
    pings, gathers = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(value, peer)
            dist.recv(value, peer)
        else:
            dist.recv(value, peer)
            dist.send(value, peer)
        pings.append((time.perf_counter() - t0) / 2)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather([torch.empty_like(value), torch.empty_like(value)], value)
        gathers.append(time.perf_counter() - t0)
    return {"message_s": statistics.median(pings), "allgather_s": statistics.median(gathers)}


def predict(per_rank: list[dict]) -> dict:
    """The step-time simulator under the measured costs: per-action medians (both variants'
    steps), the median optimizer step of the slower rank, message and all-gather latency."""
    from zbcompile.schedules import Costs
    from zbcompile.schedules.render import to_svg
    from zbcompile.schedules.steps import compare_step_times

    schedule = per_rank[0]["schedule"]
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    for result in per_rank:
        for variant in VARIANTS:
            for timeline in result["timelines"][variant]:
                for action, start, end in timeline:
                    durations[(int(action[0]), action[1])].append(end - start)
    med = {k: statistics.median(v) for k, v in durations.items()}
    stages = schedule.stages
    costs = Costs(
        f=[med.get((s, "F"), 0.0) for s in range(stages)],
        i=[med.get((s, "I"), med.get((s, "B"), 0.0)) for s in range(stages)],
        w=[med.get((s, "W"), 0.0) for s in range(stages)],
        comm=per_rank[0]["latency"]["message_s"],
    )
    optimizer = max(statistics.median(r["optimizer_s"]["post-validated"]) for r in per_rank)
    results = compare_step_times(
        schedule, costs, steps=6, optimizer=optimizer, allreduce=per_rank[0]["latency"]["allgather_s"]
    )
    for mode, result in results.items():
        boxes = [b for b in result.boxes if b.action.split(":")[0] in ("step2", "step3")]
        (_launch.RESULTS / f"post_validation_{mode}.svg").write_text(
            to_svg(boxes, title=f"{schedule.name}: {mode}, two steps")
        )
    return {
        "f_ms": [1e3 * x for x in costs.f],
        "b_ms": [1e3 * x for x in costs.i],
        "w_ms": [1e3 * x for x in costs.w],
        "comm_ms": 1e3 * costs.comm,
        "optimizer_ms": 1e3 * optimizer,
        "allgather_ms": 1e3 * per_rank[0]["latency"]["allgather_s"],
        "sync_ms": 1e3 * results["barrier"].step_time,
        "post_validated_ms": 1e3 * results["post-validation"].step_time,
        "ratio": results["barrier"].step_time / results["post-validation"].step_time,
    }


def analyse(per_rank: list[dict], settings: Settings, before: dict, after: dict, wall_s: float) -> dict:
    # a round's time is the slower rank's (both leave the round at its closing barrier)
    times = {v: [max(r["times"][v][i] for r in per_rank) for i in range(settings.rounds)] for v in VARIANTS}
    medians = {v: _launch.median(t) for v, t in times.items()}
    history = per_rank[0]["history"]
    # per round: cores' worth of CPU that other jobs used meanwhile (machine busy time minus both
    # ranks' own CPU time over the wall time); the quiet half are the rounds where that was least
    others = [
        sum(max(0.0, per_rank[0]["usage"][v][i][2] - sum(r["usage"][v][i][1] for r in per_rank)) for v in VARIANTS)
        / sum(per_rank[0]["usage"][v][i][0] for v in VARIANTS)
        for i in range(settings.rounds)
    ]
    quiet = sorted(range(settings.rounds), key=lambda i: others[i])[: max(1, settings.rounds // 2)]
    paired = [times["sync"][i] / times["post-validated"][i] for i in range(settings.rounds)]
    return {
        "settings": asdict(settings),
        "machine_before": before,
        "machine_after": after,
        "wall_s": wall_s,
        "max_norm": per_rank[0]["max_norm"],
        "ms_per_step": {v: [1e3 * t for t in ts] for v, ts in times.items()},
        "median_ms": {v: 1e3 * m for v, m in medians.items()},
        "throughput_ratio": medians["sync"] / medians["post-validated"],
        "paired_ratio_median": _launch.median(paired),
        "quiet_rounds": sorted(quiet),
        "others_cores": others,
        "quiet_median_ms": {v: 1e3 * _launch.median([times[v][i] for i in quiet]) for v in VARIANTS},
        "quiet_paired_ratio_median": _launch.median([paired[i] for i in quiet]),
        "clipped_steps": {v: sum(1 for _, c, _ in h if c) for v, h in history.items()},
        "steps": {v: len(h) for v, h in history.items()},
        "rollbacks_per_rank": [r["rollbacks"] for r in per_rank],
        "prediction": predict(per_rank),
    }


def report(data: dict) -> str:
    s, p = data["settings"], data["prediction"]
    med = data["median_ms"]
    rows = [
        [
            "sync (all-gather of the norm, then clip, then step)",
            f"{med['sync']:.1f}",
            f"{1e3 / med['sync']:.2f}",
            "1.00x",
            f"{p['sync_ms']:.1f}",
        ],
        [
            'post-validated (rollback="exact")',
            f"{med['post-validated']:.1f}",
            f"{1e3 / med['post-validated']:.2f}",
            f"{data['throughput_ratio']:.3f}x",
            f"{p['post_validated_ms']:.1f}",
        ],
    ]
    return "\n".join(
        [
            "# Gradient clipping with and without the end-of-step barrier",
            "",
            f"GPT (untied embeddings) vocab {s['vocab']}, seq {s['seq_len']}, hidden {s['hidden']}, heads "
            f"{s['heads']}, "
            f"{s['layers']} layers; {s['rows']} rows per microbatch, m={s['microbatches']}, {s['schedule']}, 2 gloo "
            "ranks "
            f"with 1 thread each; AdamW, max_norm {data['max_norm']:.3f} ({s['max_norm_factor']}x the median norm of "
            "the warm-up steps).",
            f"{s['rounds']} rounds alternating the two variants (order reversed every other round); per round "
            f"{s['steps_per_round']} steps back to back between two barriers (the post-validated variant's `finish()` "
            "inside).",
            f"Machine: {_launch.load_line(data['machine_before'])} before, {_launch.load_line(data['machine_after'])} "
            "after. "
            f"Run took {data['wall_s']:.0f} s.",
            "",
            _launch.table(["variant", "median ms/step", "steps/s", "throughput vs sync", "simulated ms/step"], rows),
            "",
            f"Throughput ratio post-validated / sync: {data['throughput_ratio']:.3f}x from the medians above; "
            f"{data['paired_ratio_median']:.3f}x as the median of the per-round ratios (each round runs both variants "
            f"back to back, so a round's ratio sees one load); over the quietest half of the rounds (other jobs used "
            f"{_launch.median([data['others_cores'][i] for i in data['quiet_rounds']]):.2f} cores, against "
            f"{_launch.median(data['others_cores']):.2f} over all rounds): sync {data['quiet_median_ms']['sync']:.1f} "
            "ms, "
            f"post-validated {data['quiet_median_ms']['post-validated']:.1f} ms per step, per-round ratio "
            f"{data['quiet_paired_ratio_median']:.3f}x.",
            "",
            f"Clipped steps: sync {data['clipped_steps']['sync']}/{data['steps']['sync']}, post-validated "
            f"{data['clipped_steps']['post-validated']}/{data['steps']['post-validated']}; optimistic steps rolled "
            "back "
            f"and redone, per rank: {data['rollbacks_per_rank']}.",
            "",
            f"Simulator (`zbcompile.schedules.steps`) under the measured costs: F {_ms(p['f_ms'])}, I "
            f"{_ms(p['b_ms'])}, "
            f"W {_ms(p['w_ms'])} ms per stage, message {p['comm_ms']:.3f} ms, all-gather {p['allgather_ms']:.3f} ms, "
            f"optimizer step {p['optimizer_ms']:.2f} ms: sync {p['sync_ms']:.1f} ms/step, post-validated "
            f"{p['post_validated_ms']:.1f} ms/step, predicted ratio {p['ratio']:.3f}x. Timelines: "
            "`post_validation_barrier.svg`, `post_validation_post-validation.svg`.",
            "",
            "Per-round ms/step: "
            + "; ".join(f"{v}: {', '.join(f'{t:.1f}' for t in ts)}" for v, ts in data["ms_per_step"].items()),
        ]
    )


def _ms(values: list[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds and a smaller model")
    parser.add_argument(
        "--max-norm-factor",
        type=float,
        default=Settings.max_norm_factor,
        help="max_norm over the warm-up steps' median norm",
    )
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    args = parser.parse_args()
    settings = Settings(rounds=args.rounds, max_norm_factor=args.max_norm_factor)
    if args.quick:
        settings = Settings(rounds=2, steps_per_round=2, layers=2, microbatches=4, max_norm_factor=args.max_norm_factor)
    before = _launch.machine()
    started = time.perf_counter()
    per_rank = _launch.run_ranks(2, rank_main, settings, timeout_s=settings.timeout_s)
    data = analyse(per_rank, settings, before, _launch.machine(), time.perf_counter() - started)
    text = report(data)
    print(text)
    if not args.quick:
        paths = _launch.write_results("post_validation", data, text)
        print("wrote", *paths)


if __name__ == "__main__":
    main()
