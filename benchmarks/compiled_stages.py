"""Training-step throughput with Inductor-compiled stage programs (`compiler="inductor"`) beside
eager stage programs (the default: aten graphs run op by op), on the CPU benchmark GPT of
benchmarks/runtime_cpu.py: 2 gloo ranks with one thread each, 2 stages, in one run.

Both pipelines are built in both ranks up front; warm-up steps (untimed; Inductor compiles each
stage's F, I and W on its first run, timed separately) come first; then rounds alternate between
the two pipelines (order reversed every other round), each timing a few steps back to back with
the optimizer step in between, as a training loop runs them. Reported: medians of steps/s and
their ratio, per microbatch count.

    flock /tmp/zbcompile-bench.lock python benchmarks/compiled_stages.py
    python benchmarks/compiled_stages.py --quick    # a smoke run (smaller model, one round)

Writes benchmarks/results/compiled_stages.{json,md}.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import _launch
import _pairing
from runtime_cpu import Settings as ModelSettings

COMPILERS = ("eager", "inductor")


@dataclass(frozen=True)
class Settings:
    model: ModelSettings = ModelSettings()
    schedule: str = "zb-h1"
    microbatches: tuple[int, ...] = (4, 8)
    warmup: int = 2
    rounds: int = 8
    steps_per_round: int = 3
    timeout_s: float = 600.0


def rank_main(settings: Settings) -> dict:
    import torch

    import zbcompile
    from zbcompile.models.gpt import lm_loss

    model_settings = settings.model
    steps, compile_s = {}, {}
    for m in settings.microbatches:
        tokens, targets = _launch.batch(model_settings, m, seed=m)
        for compiler in COMPILERS:
            pipe = zbcompile.pipeline(
                _pairing.model(model_settings), stages=2, microbatches=m, loss_fn=lm_loss, schedule=settings.schedule,
                split_points=[f"blocks.{model_settings.layers // 2}"], timeout=settings.timeout_s, compiler=compiler,
            )
            pipe.compile(tokens, target=targets)
            optimizer = torch.optim.SGD(pipe.parameters(), lr=model_settings.lr)
            steps[(compiler, m)] = _pairing.training_step(pipe, optimizer, tokens, targets)
    for key, step in steps.items():
        started = time.perf_counter()
        _pairing.between_barriers(step)  # the first step: Inductor compiles here
        compile_s[f"{key[0]} m={key[1]}"] = time.perf_counter() - started
        _pairing.between_barriers(step, settings.warmup)
    times = _pairing.rounds(
        list(steps), settings.rounds, lambda key: _pairing.between_barriers(steps[key], settings.steps_per_round),
        after=lambda r, _: f"round {r + 1}/{settings.rounds} done",
    )
    return {"times": times, "first_step_s": compile_s}


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    rows = []
    for m in settings.microbatches:
        row = {"m": m}
        for compiler in COMPILERS:
            per_round = _pairing.slowest(r["times"][(compiler, m)] for r in per_rank)
            row[f"{compiler}_step_ms"] = 1e3 * _launch.median(per_round)
            row[f"{compiler}_steps_per_s"] = 1.0 / _launch.median(per_round)
            row[f"{compiler}_first_step_s"] = max(r["first_step_s"][f"{compiler} m={m}"] for r in per_rank)
        row["speedup"] = row["inductor_steps_per_s"] / row["eager_steps_per_s"]
        rows.append(row)
    return {"rows": rows, "per_rank_times": [{f"{c} m={m}": t for (c, m), t in r["times"].items()} for r in per_rank]}


def report(data: dict) -> str:
    s, model = data["settings"], data["settings"]["model"]
    return "\n".join([
        "# Inductor-compiled stage programs against eager stage programs (CPU)",
        "",
        f"GPT (untied embeddings) vocab {model['vocab']}, seq {model['seq_len']}, hidden {model['hidden']}, heads "
        f"{model['heads']}, {model['layers']} layers; {model['rows']} rows per microbatch; 2 stages split at "
        f"blocks.{model['layers'] // 2} on 2 gloo ranks, 1 thread each; schedule {s['schedule']}.",
        f"Per pipeline: 1 first step (Inductor compiles F, I and W there), {s['warmup']} warm-up steps, then "
        f"{s['rounds']} rounds alternating between eager and inductor (order reversed every other round), "
        f"{s['steps_per_round']} steps back to back per round with the optimizer step; medians over rounds of the "
        "slower rank's time per step.",
        f"Machine: {_launch.before_after(data)}. Run took {data['wall_s']:.0f} s.",
        "",
        _launch.table(
            ["m", "eager steps/s", "inductor steps/s", "inductor / eager", "eager ms/step", "inductor ms/step",
             "first step s (eager / inductor)"],
            [
                [r["m"], f"{r['eager_steps_per_s']:.2f}", f"{r['inductor_steps_per_s']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['eager_step_ms']:.1f}", f"{r['inductor_step_ms']:.1f}",
                 f"{r['eager_first_step_s']:.1f} / {r['inductor_first_step_s']:.1f}"]
                for r in data["rows"]
            ],
        ),
    ])


def main() -> None:
    parser = _launch.parser(__doc__.split("\n\n")[0], "a smoke run: smaller model, m=4, one round")
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    options = parser.parse_args()
    settings = Settings(rounds=options.rounds)
    if options.quick:
        model = ModelSettings(hidden=32, seq_len=16, layers=2)
        settings = Settings(model=model, microbatches=(4,), warmup=1, rounds=1, steps_per_round=1)
    _launch.run_and_report("compiled_stages", 2, rank_main, settings, analyse, report, write=_launch.writes(options))


if __name__ == "__main__":
    main()
