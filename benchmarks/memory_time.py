"""Activation memory against step time: a 12-layer GPT on p = 2 gloo ranks (one thread each)
at m = 2p microbatches, under 1f1b, zb-h1, zb-h2 and zb-auto (static costs), three ways:

- plain: every activation saved;
- checkpoint: every block under `torch.utils.checkpoint` (`GPTConfig(checkpoint=True)`);
- recompute="auto": the compiler's choice under a memory limit 30% below the plain zb-h1 run's
  measured peak (one compile per schedule: the choice depends on the schedule).

zb-auto runs with its default options: no limit, except for the checkpointed model, whose default
is 1F1B's peak per rank (`schedules/memory_limit.default_limit`).

Per row: the measured peak activation bytes (the largest over ranks; the runtime counting what
lives inside each action too, `measure_transients`: the recomputed activations inside the
backward, the per-microbatch parameter gradients before they are added), in a step of its own,
beside the simulator's prediction for the same schedule and compile with each action's own peak
(`CompiledPipeline.peak_memory_with_transients`) and the M_B/M_W model's (stashed values between
actions only); and the median step time (between barriers, pipelines alternating round by round,
nothing measured but time) beside the simulator's makespan, both relative to plain 1f1b (the
simulator's times are static FLOP-equivalents, so only ratios compare).

    python benchmarks/memory_time.py            # a few minutes on 2 cores
    python benchmarks/memory_time.py --quick    # a smoke run (smaller model, fewer steps): prints only

Writes benchmarks/results/memory_time.{json,md} (not with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import _launch
import _pairing

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto")
RANKS = 2
MICROBATCHES = 2 * RANKS
LIMIT_FRACTION = 0.7


def _prediction(pipe) -> dict:
    """The simulator's peak activation bytes (largest rank; with each action's own peak, and the
    M_B/M_W model's) and makespan for `pipe`'s schedule."""
    from zbcompile.schedules import simulate

    compiled = pipe.compiled
    predicted = simulate(pipe.schedule, compiled.schedule_costs())
    unit = compiled.memory_unit()
    return {
        "predicted_peak_bytes": max(compiled.peak_memory_with_transients(pipe.schedule)) * unit,
        "predicted_stash_bytes": max(predicted.peak_memory) * unit,
        "predicted_makespan": predicted.makespan,
        "recompute_levels": list(compiled.recompute_levels),
    }


def _measured_peak(pipe, tokens, target) -> int:
    """This rank's peak activation bytes in one step, what lives inside actions included."""
    pipe.runner.measure_transients(True)
    pipe.runner.reset_peaks()
    pipe.step(tokens, target=target)
    pipe.zero_grad()
    pipe.runner.measure_transients(False)
    return pipe.runner.peak_activation_bytes


def _rank(config_fields: dict, rounds: int) -> dict:
    """Every (variant, schedule) pipeline built, warmed up and its peak measured in a step of its
    own, then `rounds` rounds of one timed step each (between barriers; the order reverses every
    other round, so that the machine's changing load falls on all alike). The recompute="auto"
    limit comes from the plain zb-h1 pipeline's measured peak, the largest over ranks."""
    import torch
    import torch.distributed as dist

    import zbcompile
    from zbcompile.models import GPT, GPTConfig
    from zbcompile.models.gpt import lm_loss

    fields = dict(config_fields)
    rows = fields.pop("rows")
    config = GPTConfig(**fields)
    generator = torch.Generator().manual_seed(0)
    tokens, target = (
        torch.randint(0, config.vocab_size, (rows * MICROBATCHES, config.seq_len), generator=generator)
        for _ in range(2)
    )

    def pipeline(checkpoint: bool, schedule: str, **options):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(config, checkpoint=checkpoint))
        pipe = zbcompile.pipeline(
            model, stages=RANKS, microbatches=MICROBATCHES, loss_fn=lm_loss, schedule=schedule, profile=False,
            timeout=300, **options,
        )
        pipe.step(tokens, target=target)  # compile and warm up
        pipe.zero_grad()
        peaks[(variant_of(checkpoint, options), schedule)] = _measured_peak(pipe, tokens, target)
        return pipe

    def variant_of(checkpoint: bool, options: dict) -> str:
        return "recompute=auto" if options else "checkpoint" if checkpoint else "plain"

    peaks: dict = {}
    pipes = {
        (variant, s): pipeline(checkpoint, s)
        for variant, checkpoint in (("plain", False), ("checkpoint", True))
        for s in SCHEDULES
    }
    reference = pipes[("plain", "zb-h1")]
    peak = torch.tensor(float(peaks[("plain", "zb-h1")]))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    limit_bytes = LIMIT_FRACTION * peak.item()
    limit = limit_bytes / reference.compiled.memory_unit()
    pipes.update({("recompute=auto", s): pipeline(False, s, memory_limit=limit, recompute="auto") for s in SCHEDULES})

    def timed(key) -> float:
        """One step between barriers: its seconds (nothing else measured)."""
        seconds = _pairing.between_barriers(lambda: pipes[key].step(tokens, target=target))
        pipes[key].zero_grad()
        return seconds

    times = _pairing.rounds(list(pipes), rounds, timed)
    return {
        key: {"peak_bytes": peaks[key], "step_s": statistics.median(times[key]), "limit_bytes": limit_bytes,
              **_prediction(pipe)}
        for key, pipe in pipes.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    config = dict(vocab_size=256, seq_len=64, hidden=128, heads=4, layers=12, rows=4)
    rounds = 9
    if args.quick:
        config.update(hidden=32, seq_len=16, rows=2)
        rounds = 2
    info = _launch.machine()
    per_rank = _launch.run_ranks(RANKS, _rank, dict(config), rounds, timeout_s=1800)
    rows = []
    for key in per_rank[0]:  # rank 0's predictions and limit; the largest peak and step over ranks
        ranks = [r[key] for r in per_rank]
        rows.append({
            "variant": key[0], "schedule": key[1], **ranks[0],
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
        })
    base = next(r for r in rows if (r["variant"], r["schedule"]) == ("plain", "1f1b"))
    lines = [
        "# Activation memory and step time (12-layer GPT, 2 ranks, m = 4)",
        "",
        f"Machine: {_launch.load_line(info)} before the run, torch {info['torch']}. Step times are medians over rounds "
        "on a shared 2-core machine: read them to a few percent.",
        f"Model: {config}. recompute=auto runs under a limit of {LIMIT_FRACTION:.0%} of plain zb-h1's measured peak "
        f"({rows[0]['limit_bytes']:,.0f} bytes). Measured peaks count what lives inside each action (the runtime's "
        "measure_transients); the predicted ones the same with each action's own peak from its graph; the M_B/M_W "
        "model's count the stashed values between actions (and a fused B's rise max(0, M_W - M_B)).",
        "",
        "| variant | schedule | peak bytes (measured) | peak bytes (predicted) | M_B/M_W model | step s | step / plain "
        "1f1b | predicted / plain 1f1b | recompute levels |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['schedule']} | {r['peak_bytes']:,} | {r['predicted_peak_bytes']:,.0f} | "
            f"{r['predicted_stash_bytes']:,.0f} | {r['step_s']:.4f} | "
            f"{r['step_s'] / base['step_s']:.2f} | {r['predicted_makespan'] / base['predicted_makespan']:.2f} | "
            f"{r['recompute_levels'] or '-'} |"
        )
    lines += ["", *_recompute_checks(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        _launch.write_results("memory_time", {"machine": info, "config": config, "rows": rows}, text)


def _recompute_checks(rows: list[dict]) -> list[str]:
    """Per schedule: whether recompute=auto fits its limit (measured) and what time it adds
    against plain, beside checkpointing every block (predicted and measured)."""
    by = {(r["variant"], r["schedule"]): r for r in rows}
    lines = []
    for s in SCHEDULES:
        plain, checkpoint, auto = (by[(v, s)] for v in ("plain", "checkpoint", "recompute=auto"))

        def added(row: dict, key: str) -> str:
            return f"{row[key] / plain[key] - 1:+.0%}"

        lines.append(
            f"- {s}: recompute=auto peak {auto['peak_bytes']:,} bytes "
            f"({'within' if auto['peak_bytes'] <= auto['limit_bytes'] else 'OVER'} the limit); added time against "
            "plain, "
            f"predicted {added(auto, 'predicted_makespan')} (checkpoint {added(checkpoint, 'predicted_makespan')}), "
            f"measured {added(auto, 'step_s')} (checkpoint {added(checkpoint, 'step_s')})"
        )
    return lines


if __name__ == "__main__":
    main()
