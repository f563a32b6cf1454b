"""Variable sequence lengths: one shape-generic compile against padding to the longest and to buckets.

Unpacked fine-tuning batches of long-tailed lengths: batch i is `microbatches x rows` sequences of one length
L_i drawn from a lognormal (median `median_len`, sigma `sigma`, clipped to `min_len`..`max_len`, seeded), its
tokens random, its targets the next token (-100 at each sequence's last position and on padding). The zoo GPT
(untied embeddings, positions up to `max_len`) trains on 2 gloo ranks in a 2-stage pipeline with default options
(zb-auto), the loss the cross-entropy over real targets (ignore_index=-100). The same batches are fed three ways,
each its own pipeline, in one launch, step i of each one after the other (the order moving every step):

- variable: each batch at its own length, default options (`dynamic=None`: the second distinct length compiles
  once more, shape-generically, and every later length runs on that compile);
- pad to global max: every batch right-padded to the longest length drawn (one shape, one compile);
- bucket padding: every batch right-padded to the top of its bucket (`buckets`) with `dynamic=False`, a compile
  per bucket, as users do today.

Each step (the optimizer's included) is timed between barriers, the slower rank's time kept; the first step also
counts the `compile()` the optimizer is built after. Printed per mode: steps, real and padded tokens, compiles
(the library's count, and the steps slower than 5x the mode's median step, scaled up to the step's padded tokens
where that is more), total seconds over every step, the steady rate in real tokens/s over the steps that did not
compile (the first of each new shape in the padded modes, of each of the first two lengths in variable), its
ratio to the padded modes', and the largest difference of a step's loss from variable's: right padding with its
targets ignored leaves a causal model's loss over the real tokens as it is, so only float rounding differs.

    python benchmarks/variable_lengths.py              # about 3 minutes on 2 quiet cores
    python benchmarks/variable_lengths.py --quick      # a smoke run, writes nothing

Writes benchmarks/results/variable_lengths.{json,md,png} (the plot: real tokens against seconds, and the steady
steps' time against the batch's length).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import _launch

MODES = ("variable", "pad to global max", "bucket padding")
SLOW = 5.0  # a step slower than this many times its expected time counts as a compile


@dataclass(frozen=True)
class Settings(_launch.Settings):
    seq_len: int = 512  # the model's positions: at least max_len
    hidden: int = 128
    layers: int = 4
    rows: int = 2  # sequences per microbatch
    microbatches: int = 4
    batches: int = 320  # steps per mode
    median_len: int = 96
    sigma: float = 0.8
    min_len: int = 32
    max_len: int = 512
    buckets: tuple[int, ...] = (64, 128, 256, 512)
    seed: int = 0
    lr: float = 1e-2


def lengths(settings: Settings) -> list[int]:
    """Each batch's length: lognormal, clipped to min_len..max_len, from `settings.seed`."""
    draw = random.Random(settings.seed)
    drawn = [draw.lognormvariate(0.0, settings.sigma) * settings.median_len for _ in range(settings.batches)]
    return [min(settings.max_len, max(settings.min_len, round(x))) for x in drawn]


def widths(settings: Settings, length: list[int]) -> dict[str, list[int]]:
    """Each mode's padded width of every batch."""
    bucket = [min(b for b in settings.buckets if b >= n) for n in length]
    return {"variable": list(length), "pad to global max": [max(length)] * len(length), "bucket padding": bucket}


def batch(settings: Settings, i: int, length: int, width: int):
    """Batch `i`: its real tokens (seeded by `i`) right-padded to `width` with token 0, and its targets (the next
    token; -100 at each sequence's last real position and on padding)."""
    import torch

    rows = settings.rows * settings.microbatches
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + i)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    tokens[:, :length] = torch.randint(1, settings.vocab, (rows, length), generator=generator)
    targets = torch.full_like(tokens, -100)
    targets[:, : length - 1] = tokens[:, 1:length]
    return tokens, targets


def loss_fn(logits, targets):  # the mean over the microbatch's real targets
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    import zbcompile

    length = lengths(settings)
    width = widths(settings, length)
    pipes, optimizers, compile_s = {}, {}, {}
    times, losses, builds = ({mode: [] for mode in MODES} for _ in range(3))  # builds: the compiles after each step

    def timed(run):
        dist.barrier()
        started = time.perf_counter()
        result = run()
        dist.barrier()
        return time.perf_counter() - started, result

    for mode in MODES:
        options = {"dynamic": False} if mode == "bucket padding" else {}
        pipes[mode] = pipe = zbcompile.pipeline(
            _launch.gpt(settings, tie_embeddings=False), stages=2, microbatches=settings.microbatches,
            loss_fn=loss_fn, timeout=settings.timeout_s, **options,
        )
        tokens, targets = batch(settings, 0, length[0], width[mode][0])
        compile_s[mode], _ = timed(lambda: pipe.compile(tokens, target=targets))  # counted in the first step
        optimizers[mode] = torch.optim.SGD(pipe.parameters(), lr=settings.lr)

    def step(mode: str, i: int):
        pipe, optimizer = pipes[mode], optimizers[mode]
        tokens, targets = batch(settings, i, length[i], width[mode][i])
        loss = pipe.step(tokens, target=targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return None if loss is None else float(loss)

    started = time.perf_counter()
    for i in range(settings.batches):
        for mode in MODES[i % len(MODES):] + MODES[: i % len(MODES)]:
            seconds, loss = timed(lambda: step(mode, i))
            times[mode].append(seconds + (compile_s[mode] if i == 0 else 0.0))
            losses[mode].append(loss)
            builds[mode].append(len(pipes[mode]._builder.builds))  # private: the compiles this pipeline made
        if (i + 1) % 32 == 0:
            _launch.say(f"step {i + 1}/{settings.batches} of each mode, {time.perf_counter() - started:.0f} s")
    return {"times": times, "losses": losses, "builds": builds, "lengths": length, "widths": width}


def compile_steps(mode: str, width: list[int]) -> set[int]:
    """The steps that compiled: the first of each new shape; in variable, the first of the first two lengths."""
    firsts = sorted(width.index(w) for w in set(width))
    return set(firsts[:2] if mode == "variable" else firsts)


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    first = per_rank[0]
    length, rows = first["lengths"], settings.rows * settings.microbatches
    real = [rows * n for n in length]
    losses = {mode: [next((r["losses"][mode][i] for r in per_rank if r["losses"][mode][i] is not None), None)
                     for i in range(settings.batches)] for mode in MODES}
    modes = {}
    for mode in MODES:
        times = [max(r["times"][mode][i] for r in per_rank) for i in range(settings.batches)]
        padded = [rows * w for w in first["widths"][mode]]
        per_token = _launch.median([t / p for t, p in zip(times, padded)])
        slow = [i for i, t in enumerate(times) if t > SLOW * max(_launch.median(times), per_token * padded[i])]
        compiled, builds = compile_steps(mode, first["widths"][mode]), [0, *first["builds"][mode]]
        steady = [i for i in range(settings.batches) if i not in compiled]
        modes[mode] = {
            "step_s": times, "real_tokens": sum(real), "padded_tokens": sum(padded), "slow_steps": slow,
            "compile_steps": sorted(compiled), "library_compiles": first["builds"][mode][-1],
            "library_compile_steps": [i for i in range(settings.batches) if builds[i + 1] > builds[i]],
            "total_s": sum(times),
            "steady_tokens_per_s": sum(real[i] for i in steady) / sum(times[i] for i in steady),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses[mode], losses["variable"])),
        }
    return {"lengths": length, "widths": first["widths"], "losses": losses, "modes": modes}


def report(data: dict) -> str:
    s, modes = data["settings"], data["modes"]
    pad, bucket = (modes[m]["steady_tokens_per_s"] for m in ("pad to global max", "bucket padding"))
    length = sorted(data["lengths"])
    rows = [[
        mode, len(m["step_s"]), m["real_tokens"], m["padded_tokens"],
        f"{m['library_compiles']} / {len(m['slow_steps'])}",
        f"{m['total_s']:.1f}", f"{m['steady_tokens_per_s']:.0f}", f"{m['steady_tokens_per_s'] / pad:.2f}x",
        f"{m['steady_tokens_per_s'] / bucket:.2f}x", f"{m['max_loss_diff']:.1e}",
    ] for mode, m in modes.items()]
    total = {mode: m["total_s"] for mode, m in modes.items()}
    return "\n".join([
        "# Variable sequence lengths: one shape-generic compile against padding",
        "",
        f"GPT ({s['layers']} layers, hidden {s['hidden']}, vocab {s['vocab']}, positions {s['seq_len']}), "
        f"{s['microbatches']} microbatches x {s['rows']} sequences per batch, 2 gloo ranks, a 2-stage pipeline "
        f"with default options (bucket padding: dynamic=False). {s['batches']} batches, lengths lognormal "
        f"(median {s['median_len']}, sigma {s['sigma']}, clipped to {s['min_len']}..{s['max_len']}): "
        f"min {length[0]}, median {length[len(length) // 2]}, max {length[-1]}; {len(set(length))} distinct. "
        f"Buckets {', '.join(map(str, s['buckets']))}. Machine: {_launch.before_after(data)}; {data['wall_s']:.0f} s.",
        "",
        _launch.table(
            ["mode", "steps", "real tokens", "padded tokens", "compiles (library / slow steps)", "total s",
             "steady real tokens/s", "vs pad to max", "vs buckets", "max loss diff vs variable"],
            rows,
        ),
        "",
        f"Total seconds, compiles included: variable {total['variable'] / total['pad to global max']:.2f}x pad to "
        f"global max's, {total['variable'] / total['bucket padding']:.2f}x bucket padding's. Steps left out of the "
        "steady rate (they compiled): " + "; ".join(f"{mode} {m['compile_steps']}" for mode, m in modes.items())
        + ". Steps in which the library compiled: "
        + "; ".join(f"{mode} {m['library_compile_steps']}" for mode, m in modes.items())
        + ". Slow steps (> 5x expected): " + "; ".join(f"{mode} {m['slow_steps']}" for mode, m in modes.items()) + ".",
    ])


def plot(data: dict, path) -> None:
    """Real tokens against seconds (compiles: flat stretches); each steady step's time against its length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["settings"]["rows"] * data["settings"]["microbatches"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, m in data["modes"].items():
        seconds, tokens, done, count = [0.0], [0], 0.0, 0
        for t, n in zip(m["step_s"], data["lengths"]):
            done, count = done + t, count + rows * n
            seconds, tokens = seconds + [done, done], tokens + [tokens[-1], count]
        left.plot(seconds, tokens, label=mode)
        steady = [i for i in range(len(m["step_s"])) if i not in m["compile_steps"]]
        right.scatter([data["lengths"][i] for i in steady], [1e3 * m["step_s"][i] for i in steady], s=12, label=mode)
    left.set(xlabel="seconds (compiles included)", ylabel="real tokens trained", title="Progress")
    right.set(xlabel="batch length L (real tokens per sequence)", ylabel="step ms", title="Steady steps")
    for axes in (left, right):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = _launch.parser(__doc__.split("\n\n")[0], "a smoke run: 10 batches of a smaller model; writes nothing")
    parser.add_argument("--batches", type=int, default=Settings.batches)
    options = parser.parse_args()
    settings = Settings(batches=options.batches)
    if options.quick:
        settings = Settings(batches=10, layers=2, hidden=32, max_len=256, seq_len=256, buckets=(64, 128, 256))
    _launch.run_and_report("variable_lengths", 2, rank_main, settings, analyse, report, _launch.writes(options))
    if _launch.writes(options):  # the plot, from the results just written
        png = _launch.RESULTS / "variable_lengths.png"
        plot(json.loads((_launch.RESULTS / "variable_lengths.json").read_text()), png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
