"""A slower rank: zb-auto re-cut by measurement against zb-auto at the compiler's cut.

Two gloo ranks train the Llama-style decoder (benchmarks/llama_style.py); rank 1's actions
(`--slowed-rank 0`: rank 0's) are slowed by `--slowdown` (default 1.5: each F, I, W sleeps half its own time more,
`pipeline(_slowdown=...)`, a testing aid standing for a slower or shared device). Two pipelines,
default options but the cut: `recut=False` (the cut the compiler balances by FLOPs; zb-auto still
re-solves its order with measured costs) and the default (the first compile measures each block
on each rank and cuts again, `runtime/tuning/recut.py`). Both are warmed up until their tuners run
schedules solved with measured costs; then rounds alternate between them, steps back to back.

Printed: each pipeline's steady step (median over rounds), the simulator's span of the running
schedule under its last measured costs (the best the simulator predicts for those costs at that
cut), the re-cut decision (the cut measured, the one chosen, the predicted step of each and the
rank speeds it saw), and two checks: the re-cut step within 10% of the simulator's prediction for
it, and at least 1.2x faster than the static cut's.

    python benchmarks/straggler.py            # a few minutes on 2 quiet cores
    python benchmarks/straggler.py --quick    # a smoke run

Writes benchmarks/results/straggler.{json,md}.
"""

from __future__ import annotations

from dataclasses import dataclass

import _launch
import _pairing

PIPELINES = ("static cut", "re-cut")


@dataclass(frozen=True)
class Settings(_launch.Settings):
    vocab: int = 512
    seq_len: int = 128
    hidden: int = 256
    layers: int = 8
    steps_per_round: int = 4
    slowdown: float = 1.5
    slowed_rank: int = 1
    max_warmup: int = 60  # steps until a tuner runs its measured schedule


def _pipeline(name: str, settings: Settings, tokens, targets):
    import llama_style
    import zbcompile
    from zbcompile.models.gpt import lm_loss

    pipe = zbcompile.pipeline(
        llama_style.llama_style(settings), stages=2, microbatches=settings.microbatches, loss_fn=lm_loss,
        timeout=settings.timeout_s, recut=name == "re-cut", _slowdown={settings.slowed_rank: settings.slowdown},
    )
    pipe.compile(tokens, target=targets)
    return pipe


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    from zbcompile.measure import steady_period

    tokens, targets = _launch.batch(settings, settings.microbatches, seed=0)
    pipes, step = {}, {}
    for name in PIPELINES:
        pipes[name] = pipe = _pipeline(name, settings, tokens, targets)
        step[name] = _pairing.training_step(pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3), tokens, targets)
    warmup = {}
    for name, pipe in pipes.items():
        taken = 0
        while (pipe.tuner.measured is None or pipe.tuner.solving) and taken < settings.max_warmup:
            step[name]()
            taken += 1
        step[name]()
        warmup[name] = taken

    def timed(name: str) -> float:
        """Seconds per step of the round's steps back to back, after one that settles after a barrier."""
        return steady_period(step[name], settings.steps_per_round + 1, settle=1, sync=dist.barrier)

    times = _pairing.rounds(
        PIPELINES, settings.rounds, timed, after=lambda r, _: f"round {r + 1}/{settings.rounds} done"
    )
    return {
        "times": times, "warmup": warmup,
        "predicted_span": {name: pipes[name].tuner.predicted_span for name in PIPELINES},
        "history": {name: list(pipes[name].tuner.history) for name in PIPELINES},
        "cuts": {name: list(pipes[name].compiled.partition.cuts) for name in PIPELINES},
        "placement": {name: _launch.placement(pipes[name].schedule) for name in PIPELINES},
        "cut_record": pipes["re-cut"].compiled.cut_record,
        "stages": {name: pipes[name].runner.local_stages for name in PIPELINES},
    }


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    first = per_rank[0]
    step = {name: _launch.median(_pairing.slowest(r["times"][name] for r in per_rank)) for name in PIPELINES}
    predicted = first["predicted_span"]
    recut, static = step["re-cut"], step["static cut"]
    checks = [
        {"check": "re-cut step within 10% of the simulator's span for its measured costs",
         "value": recut / predicted["re-cut"], "holds": recut <= 1.10 * predicted["re-cut"]},
        {"check": "re-cut step at least 1.2x faster than the static cut's",
         "value": static / recut, "holds": static >= 1.2 * recut},
    ]
    return {
        "step_s": step, "predicted_span_s": predicted, "checks": checks,
        **{k: first[k] for k in ("warmup", "history", "cuts", "placement", "cut_record")},
    }


def report(data: dict) -> str:
    s = data["settings"]
    cut = data["cut_record"] or {}
    return "\n".join([
        "# A slower rank: zb-auto re-cut by measurement against the compiler's cut",
        "",
        f"Llama-style decoder ({s['layers']} layers, hidden {s['hidden']}, vocab {s['vocab']}, seq {s['seq_len']}), "
        f"{s['rows']} rows per microbatch, m={s['microbatches']}, 2 gloo ranks; rank {s.get('slowed_rank', 1)} slowed "
        f"{s['slowdown']}x (`_slowdown`, a testing aid). Machine: {_launch.before_after(data)}; "
        f"{data['wall_s']:.0f} s.",
        "",
        _launch.table(
            ["pipeline", "cut", "placement", "steady step ms", "simulated span ms (its measured costs)",
             "warm-up steps"],
            [[name, data["cuts"][name], data["placement"][name], f"{1e3 * data['step_s'][name]:.1f}",
              f"{1e3 * (data['predicted_span_s'][name] or float('nan')):.1f}", data["warmup"][name]]
             for name in PIPELINES],
        ),
        "",
        f"Decision: measured {cut.get('measured', {}).get('cut')}, chosen {cut.get('chosen', {}).get('cut')} "
        f"(predicted {cut.get('predicted_gain', float('nan')):.3f}x); rank speeds "
        f"{', '.join(f'{x:.2f}' for x in cut.get('rank_speeds', []))}; {cut.get('reason')}",
        "",
        _launch.table(
            ["check", "value", "holds"],
            [[c["check"], f"{c['value']:.3f}", "yes" if c["holds"] else "NO"] for c in data["checks"]],
        ),
    ])


def main() -> None:
    parser = _launch.parser(__doc__.split("\n\n")[0], "a smoke run: a small model, 2 rounds")
    parser.add_argument("--slowdown", type=float, default=Settings.slowdown)
    parser.add_argument("--slowed-rank", type=int, choices=(0, 1), default=Settings.slowed_rank)
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--rows", type=int, default=Settings.rows)
    options = parser.parse_args()
    settings = Settings(
        slowdown=options.slowdown, slowed_rank=options.slowed_rank, rounds=options.rounds, rows=options.rows
    )
    if options.quick:
        settings = Settings(
            seq_len=32, hidden=64, rows=1, rounds=2, steps_per_round=2, slowdown=options.slowdown,
            slowed_rank=options.slowed_rank,
        )
    _launch.run_and_report("straggler", 2, rank_main, settings, analyse, report, write=_launch.writes(options))


if __name__ == "__main__":
    main()
