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

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import _launch
import _pairing
from zbcompile import measure

VARIANTS = ("sync", "post-validated")


@dataclass(frozen=True)
class Settings(_launch.Settings):
    rounds: int = 20
    timeout_s: float = 300.0
    schedule: str = "zb-h1"
    warmup: int = 2
    lr: float = 1e-3
    max_norm_factor: float = 4.0  # max_norm = this x the median gradient norm of the warm-up steps


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    import zbcompile
    from zbcompile.models.gpt import lm_loss

    model = _launch.gpt(settings, tie_embeddings=False)
    tokens, targets = _launch.batch(settings, settings.microbatches, seed=1)
    pipe = zbcompile.pipeline(
        model, stages=2, microbatches=settings.microbatches, loss_fn=lm_loss, schedule=settings.schedule,
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
        variant: clipping(torch.optim.AdamW(pipe.parameters(), lr=settings.lr), pipe, max_norm=max_norm)
        for variant, clipping in zip(VARIANTS, (zbcompile.SynchronousClipOptimizer, zbcompile.PostValidatedOptimizer))
    }
    # per variant and round: wall seconds, this rank's CPU seconds, the machine's busy CPU seconds
    usage: dict[str, list[measure.Usage]] = defaultdict(list)
    timelines: dict[str, list] = defaultdict(list)
    optimizer_s: dict[str, list[float]] = defaultdict(list)

    def run(variant: str) -> float:
        """Seconds per step of the round's steps back to back between two barriers, `finish()` inside."""
        opt = optimizers[variant]
        dist.barrier()
        before = measure.Usage.now()
        for _ in range(settings.steps_per_round):
            pipe.step(tokens, target=targets)
            timelines[variant].append(list(pipe.runner.timeline))
            t0 = time.perf_counter()
            opt.step()
            optimizer_s[variant].append(time.perf_counter() - t0)
            opt.zero_grad()
        opt.finish()
        dist.barrier()
        usage[variant].append(measure.Usage.now().since(before))
        return usage[variant][-1].wall_s / settings.steps_per_round

    for variant in VARIANTS:  # warm-up of each variant's code path
        run(variant)
    for kept in (usage, timelines, optimizer_s):
        kept.clear()
    times = _pairing.rounds(
        VARIANTS, settings.rounds, run,
        after=lambda r, done: f"round {r + 1}/{settings.rounds}: "
        + ", ".join(f"{v} {1e3 * done[v][-1]:.1f} ms/step" for v in VARIANTS),
    )
    optimizers["post-validated"].close()
    return {
        "times": times, "usage": dict(usage), "timelines": dict(timelines), "optimizer_s": dict(optimizer_s),
        "latency": _latencies(dist, torch), "max_norm": max_norm,
        "history": {v: [(h.total_norm, h.clipped, h.skipped) for h in o.history] for v, o in optimizers.items()},
        "rollbacks": optimizers["post-validated"].rollbacks, "schedule": pipe.schedule,
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
    from zbcompile.runtime.tuning.profile import action_medians
    from zbcompile.schedules.render import to_svg
    from zbcompile.schedules.steps import compare_step_times

    schedule = per_rank[0]["schedule"]
    medians = action_medians([timeline for r in per_rank for v in VARIANTS for timeline in r["timelines"][v]])
    costs = _pairing.stage_costs(medians, schedule.stages, per_rank[0]["latency"]["message_s"])
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
        **_pairing.costs_ms(costs),
        "optimizer_ms": 1e3 * optimizer, "allgather_ms": 1e3 * per_rank[0]["latency"]["allgather_s"],
        "sync_ms": 1e3 * results["barrier"].step_time, "post_validated_ms": 1e3 * results["post-validation"].step_time,
        "ratio": results["barrier"].step_time / results["post-validation"].step_time,
    }


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    # a round's time is the slower rank's (both leave the round at its closing barrier)
    times = {v: _pairing.slowest(r["times"][v] for r in per_rank) for v in VARIANTS}
    medians = {v: _launch.median(t) for v, t in times.items()}
    history = per_rank[0]["history"]
    # per round: cores' worth of CPU that other jobs used meanwhile (machine busy time minus both
    # ranks' own CPU time over the wall time); the quiet half are the rounds where that was least
    usage = [{v: [r["usage"][v][i] for r in per_rank] for v in VARIANTS} for i in range(settings.rounds)]
    others = [
        sum(max(0.0, u[v][0].machine_busy_s - sum(x.own_cpu_s for x in u[v])) for v in VARIANTS)
        / sum(u[v][0].wall_s for v in VARIANTS)
        for u in usage
    ]
    quiet = sorted(range(settings.rounds), key=lambda i: others[i])[: max(1, settings.rounds // 2)]
    paired = [times["sync"][i] / times["post-validated"][i] for i in range(settings.rounds)]
    return {
        "max_norm": per_rank[0]["max_norm"], "ms_per_step": {v: [1e3 * t for t in ts] for v, ts in times.items()},
        "median_ms": {v: 1e3 * m for v, m in medians.items()},
        "throughput_ratio": medians["sync"] / medians["post-validated"], "paired_ratio_median": _launch.median(paired),
        "quiet_rounds": sorted(quiet), "others_cores": others,
        "quiet_median_ms": {v: 1e3 * _launch.median([times[v][i] for i in quiet]) for v in VARIANTS},
        "quiet_paired_ratio_median": _launch.median([paired[i] for i in quiet]),
        "clipped_steps": {v: sum(1 for _, c, _ in h if c) for v, h in history.items()},
        "steps": {v: len(h) for v, h in history.items()}, "rollbacks_per_rank": [r["rollbacks"] for r in per_rank],
        "prediction": predict(per_rank),
    }


def report(data: dict) -> str:
    s, p = data["settings"], data["prediction"]
    med, quiet = data["median_ms"], data["quiet_median_ms"]
    rows = [
        ["sync (all-gather of the norm, then clip, then step)", f"{med['sync']:.1f}", f"{1e3 / med['sync']:.2f}",
         "1.00x", f"{p['sync_ms']:.1f}"],
        ['post-validated (rollback="exact")', f"{med['post-validated']:.1f}", f"{1e3 / med['post-validated']:.2f}",
         f"{data['throughput_ratio']:.3f}x", f"{p['post_validated_ms']:.1f}"],
    ]
    clipped, steps = data["clipped_steps"], data["steps"]
    return "\n".join([
        "# Gradient clipping with and without the end-of-step barrier",
        "",
        f"GPT (untied embeddings) vocab {s['vocab']}, seq {s['seq_len']}, hidden {s['hidden']}, heads {s['heads']}, "
        f"{s['layers']} layers; {s['rows']} rows per microbatch, m={s['microbatches']}, {s['schedule']}, 2 gloo ranks "
        f"with 1 thread each; AdamW, max_norm {data['max_norm']:.3f} ({s['max_norm_factor']}x the median norm of "
        "the warm-up steps).",
        f"{s['rounds']} rounds alternating the two variants (order reversed every other round); per round "
        f"{s['steps_per_round']} steps back to back between two barriers (the post-validated variant's `finish()` "
        "inside).",
        f"Machine: {_launch.before_after(data)}. Run took {data['wall_s']:.0f} s.",
        "",
        _launch.table(["variant", "median ms/step", "steps/s", "throughput vs sync", "simulated ms/step"], rows),
        "",
        f"Throughput ratio post-validated / sync: {data['throughput_ratio']:.3f}x from the medians above; "
        f"{data['paired_ratio_median']:.3f}x as the median of the per-round ratios (each round runs both variants "
        f"back to back, so a round's ratio sees one load); over the quietest half of the rounds (other jobs used "
        f"{_launch.median([data['others_cores'][i] for i in data['quiet_rounds']]):.2f} cores, against "
        f"{_launch.median(data['others_cores']):.2f} over all rounds): sync {quiet['sync']:.1f} ms, "
        f"post-validated {quiet['post-validated']:.1f} ms per step, per-round ratio "
        f"{data['quiet_paired_ratio_median']:.3f}x.",
        "",
        f"Clipped steps: sync {clipped['sync']}/{steps['sync']}, post-validated "
        f"{clipped['post-validated']}/{steps['post-validated']}; optimistic steps rolled back "
        f"and redone, per rank: {data['rollbacks_per_rank']}.",
        "",
        f"Simulator (`zbcompile.schedules.steps`) under the measured costs: F {_ms(p['f_ms'])}, I {_ms(p['b_ms'])}, "
        f"W {_ms(p['w_ms'])} ms per stage, message {p['comm_ms']:.3f} ms, all-gather {p['allgather_ms']:.3f} ms, "
        f"optimizer step {p['optimizer_ms']:.2f} ms: sync {p['sync_ms']:.1f} ms/step, post-validated "
        f"{p['post_validated_ms']:.1f} ms/step, predicted ratio {p['ratio']:.3f}x. Timelines: "
        "`post_validation_barrier.svg`, `post_validation_post-validation.svg`.",
        "",
        "Per-round ms/step: "
        + "; ".join(f"{v}: {', '.join(f'{t:.1f}' for t in ts)}" for v, ts in data["ms_per_step"].items()),
    ])


def _ms(values: list[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = _launch.parser(__doc__.splitlines()[0], "a smoke run: fewer rounds and a smaller model", no_write=False)
    parser.add_argument("--max-norm-factor", type=float, default=Settings.max_norm_factor,
                        help="max_norm over the warm-up steps' median norm")
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    args = parser.parse_args()
    settings = Settings(rounds=args.rounds, max_norm_factor=args.max_norm_factor)
    if args.quick:
        settings = Settings(rounds=2, steps_per_round=2, layers=2, microbatches=4, max_norm_factor=args.max_norm_factor)
    _launch.run_and_report("post_validation", 2, rank_main, settings, analyse, report, write=_launch.writes(args))


if __name__ == "__main__":
    main()
