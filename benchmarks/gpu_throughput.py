"""Throughput of a pipeline's stage programs on one device against the model run without us.

One process holds every stage (the local runner) on one GPU, so what is measured is what the
compiled stage programs cost against the model itself, not what pipelining gains. Per model, in
bf16 with flash attention (`scaled_dot_product_attention` on CUDA):

- eager: `pipe.step` (eager stage programs, aten graphs run op by op) against the eager model's
  forward + backward over the same microbatches (each microbatch's loss / m, backward);
- inductor: `pipe.step` with `compiler="inductor"` against `torch.compile(model)` the same way.

Rounds alternate between the two (order reversed every other round), a few steps back to back
per round, the device synchronised only around a round; tokens/s and model FLOP utilisation
(MFU: the compile's FLOP count of F, I and W per microbatch, times m, per second, over the
device's peak) are reported for both, beside the paper's and torchtitan's published MFU. The
pipeline's per-action overhead is read off its CUDA-event timeline: the device's idle time
between consecutive actions (host time the device waited for), per action. A kernel table of one
step of each (torch.profiler) shows where the time goes.

    python benchmarks/gpu_throughput.py --model gpt-1.5b --compiler eager --out DIR   # one part
    python benchmarks/gpu_throughput.py --report DIR      # benchmarks/results/gpu_throughput.{md,json}
    python benchmarks/gpu_throughput.py --device cpu --tiny --out DIR ...   # every code path, CPU

Each part appends one JSON line to DIR/gpu_throughput.jsonl and appends its kernel tables to
DIR/gpu_kernels.txt (benchmarks/gpu_check.sh runs the parts, each under a timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _launch  # noqa: E402
import _pairing  # noqa: E402

COMPILERS = ("eager", "inductor")
MODELS = ("gpt-1.5b", "llama-1b")
# Published MFU for comparison (bf16, no float8), with where each number comes from.
PUBLISHED_MFU = (
    ("Zero Bubble paper, 1.5B GPT, ZB-2p, 8 x A100 (Table 4: 14.5 samples/GPU/s)", "paper"),
    ("torchtitan, Llama 3.1 8B, FSDP on 8 x H100 (benchmarks/llama3_h100_202412)", "33% - 39%"),
    ("torchtitan, Llama 3 8B, FSDP on 64 x A100 (docs/performance.md)", "56.8% - 58.2%"),
)
A100_PEAK = 312e12


@dataclass(frozen=True)
class Part:
    model: str
    compiler: str
    stages: int = 4
    microbatches: int = 8
    rows: int = 6  # sequences per microbatch
    seq_len: int = 1024
    warmup: int = 4  # pipeline steps before timing (compile, profiled steps, the re-solve's switch)
    rounds: int = 4
    steps_per_round: int = 3
    tiny: bool = False


def paper_mfu() -> float:
    """The paper's 1.5B GPT (22 layers, hidden 2304, sequence 1024, vocabulary 50304) at ZB-2p's
    14.5 samples per GPU per second on A100s, with the paper's per-layer FLOPs (Table 1: F, B, W
    = sh(24h + 4s), sh(24h + 8s), 24sh^2 per sample) and the LM head's 6shV."""
    s, h, layers, vocab = 1024, 2304, 22, 50304
    per_sample = layers * s * h * (72 * h + 12 * s) + 6 * s * h * vocab
    return 14.5 * per_sample / A100_PEAK


# --- models ---------------------------------------------------------------------------------


def build(part: Part, device, dtype) -> tuple[Any, Callable, Callable, dict]:
    """(model on `device` in `dtype`, batch(step) -> (args, kwargs), eager_loss(model, args,
    kwargs), pipeline keyword arguments) for `part.model`."""
    import torch

    torch.manual_seed(0)

    def batch_of(vocab: int, labels: Callable) -> Callable:
        """batch(step): tokens below `vocab` from seed `step`, and `labels(tokens)` as keyword arguments."""

        def batch(step: int):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, vocab, (part.rows * part.microbatches, part.seq_len), generator=g).to(device)
            return (tokens,), labels(tokens)

        return batch

    if part.model == "gpt-1.5b":
        from zbcompile.models import GPT, GPTConfig
        from zbcompile.models.gpt import lm_loss

        shape = dict(vocab_size=50304, hidden=2304, heads=24, layers=22)
        if part.tiny:
            shape = dict(vocab_size=128, hidden=64, heads=4, layers=4)
        with torch.device(device):
            model = GPT(GPTConfig(seq_len=part.seq_len, **shape)).to(dtype)

        def eager_loss(module, args, kwargs):
            return lm_loss(module(*args), kwargs["target"])

        batch = batch_of(shape["vocab_size"], lambda tokens: {"target": tokens.roll(-1, 1)})
        return model, batch, eager_loss, {"loss_fn": lm_loss}
    if part.model == "llama-1b":
        import transformers

        transformers.logging.set_verbosity_error()
        # Llama 3.2 1B's shape (tied embeddings); random weights, no download
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        sizes = (128, 64, 128, 4, 4) if part.tiny else (128256, 2048, 8192, 16, 32)
        shape = dict(zip(names, sizes), num_key_value_heads=sizes[-1] // 4)
        config = transformers.LlamaConfig(
            **shape, max_position_embeddings=max(part.seq_len, 128), tie_word_embeddings=True, rope_theta=500000.0,
            attn_implementation="sdpa",
        )
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(dtype)

        def eager_loss(module, args, kwargs):
            return module(*args, **kwargs).loss

        return model, batch_of(shape["vocab_size"], lambda tokens: {"labels": tokens}), eager_loss, {}
    raise ValueError(f"unknown model {part.model!r}; choose one of {', '.join(MODELS)}")


# --- one part -------------------------------------------------------------------------------


def eager_step(module, eager_loss, args, kwargs, microbatches: int) -> None:
    """The model's forward + backward over the batch's microbatches, one at a time, each
    microbatch's loss / m (the gradient a pipeline step computes)."""
    pieces_args = [a.chunk(microbatches) for a in args]
    pieces_kwargs = {k: v.chunk(microbatches) for k, v in kwargs.items()}
    for i in range(microbatches):
        loss = eager_loss(module, [p[i] for p in pieces_args], {k: v[i] for k, v in pieces_kwargs.items()})
        (loss / microbatches).backward()


def model_flops(pipe) -> int:
    """FLOPs of one step: every stage's F, I and W per microbatch (the compile's count), times m."""
    per_microbatch = sum(
        p.cost.forward.flops + p.cost.input_backward.flops + p.cost.weight_backward.flops
        for p in pipe.compiled.programs
    )
    return per_microbatch * pipe.options.microbatches


def action_gaps(timeline) -> dict:
    """From one step's (action, start, end) intervals: the device's idle time between
    consecutive actions (the host's time the device waited for), per action and by kind."""
    ordered = sorted(timeline, key=lambda t: t[1])
    gaps: dict[str, list[float]] = {}
    for (_, _, end), (text, start, _) in zip(ordered, ordered[1:]):
        kind = "".join(c for c in text if c.isalpha())
        gaps.setdefault(kind, []).append(max(0.0, start - end) * 1e3)
    busy = sum(end - start for _, start, end in ordered) * 1e3
    span = (ordered[-1][2] - ordered[0][1]) * 1e3 if ordered else 0.0
    every = [g for values in gaps.values() for g in values]
    return {
        "actions": len(ordered),
        "busy_ms": round(busy, 3),
        "span_ms": round(span, 3),
        "mean_gap_ms": round(sum(every) / len(every), 4) if every else 0.0,
        "max_gap_ms": round(max(every), 4) if every else 0.0,
        "mean_gap_ms_before": {k: round(sum(v) / len(v), 4) for k, v in sorted(gaps.items())},
    }


def kernel_table(run_one: Callable, device, rows: int = 15) -> tuple[str, dict[str, float]]:
    """torch.profiler over one call of `run_one`: the top kernels (device time) as text, and
    every kernel's total device ms by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_one()
        _pairing.DeviceClock(device)()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    totals = {
        e.key: (getattr(e, "self_device_time_total", 0.0) if device.type == "cuda" else e.self_cpu_time_total) / 1e3
        for e in averages
    }
    return averages.table(sort_by=sort, row_limit=rows, max_name_column_width=70), totals


def kernel_differences(baseline: dict[str, float], pipeline: dict[str, float], rows: int = 20) -> str:
    """The kernels whose device ms differ most between the two, one line each (pipeline minus baseline)."""
    names = sorted(set(baseline) | set(pipeline), key=lambda n: -abs(pipeline.get(n, 0.0) - baseline.get(n, 0.0)))
    return "\n".join(f"{n[:90]:90s} {pipeline.get(n, 0.0) - baseline.get(n, 0.0):+9.3f}" for n in names[:rows])


def run_part(part: Part, device_name: str, out_dir: pathlib.Path) -> dict:
    import torch

    import zbcompile

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    clock = _pairing.DeviceClock(device)
    model, batch, eager_loss, pipe_kwargs = build(part, device, dtype)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    baseline = model if part.compiler == "eager" else torch.compile(model)
    pipe = zbcompile.pipeline(
        model, stages=part.stages, microbatches=part.microbatches, compiler=part.compiler, **pipe_kwargs
    )
    args, kwargs = batch(0)
    target = kwargs.pop("target", None)

    def run_baseline() -> None:
        labels = {**kwargs, **({"target": target} if target is not None else {})}
        eager_step(baseline, eager_loss, args, labels, part.microbatches)
        model.zero_grad(set_to_none=True)

    def run_pipe() -> None:
        pipe.step(*args, target=target, **kwargs)
        pipe.zero_grad(set_to_none=True)

    runs = {"baseline": run_baseline, "pipeline": run_pipe}
    first = {}
    for name, count in (("baseline", 2), ("pipeline", part.warmup)):
        started = clock()
        runs[name]()
        first[name] = clock() - started
        for _ in range(count - 1):
            runs[name]()

    def timed(name: str) -> float:
        started = clock()
        for _ in range(part.steps_per_round):
            runs[name]()
        return (clock() - started) / part.steps_per_round

    samples = _pairing.rounds(runs, part.rounds, timed)
    gaps = action_gaps(pipe.runner.timeline)
    base_kernels, base_totals = kernel_table(run_baseline, device)
    pipe_kernels, pipe_totals = kernel_table(run_pipe, device)
    baseline_name = "eager model" if part.compiler == "eager" else "torch.compile(model)"
    with open(out_dir / "gpu_kernels.txt", "a") as kernels:
        kernels.write(
            f"## {part.model}, {part.compiler}\n# one step of the {baseline_name}\n{base_kernels}\n"
            f"# one pipe.step ({part.compiler} stage programs)\n{pipe_kernels}\n"
            f"# kernels by device ms, pipeline minus baseline (largest differences)\n"
            f"{kernel_differences(base_totals, pipe_totals)}\n\n"
        )
    tokens = part.rows * part.microbatches * part.seq_len
    flops = model_flops(pipe)
    peak = _peak_flops(device)
    step_s = {name: _launch.median(values) for name, values in samples.items()}
    return {
        "part": asdict(part), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "parameters": params, "schedule": pipe.schedule.name,
        "tokens_per_step": tokens, "flops_per_step": flops, "peak_flops": peak,
        "first_step_s": {k: round(v, 3) for k, v in first.items()},
        "step_ms": {k: [round(v * 1e3, 3) for v in values] for k, values in samples.items()},
        "median_step_ms": {k: round(v * 1e3, 3) for k, v in step_s.items()},
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in step_s.items()},
        "mfu": {k: round(flops / v / peak, 4) for k, v in step_s.items()} if peak else None,
        "pipeline_over_baseline": round(step_s["baseline"] / step_s["pipeline"], 4),
        "action_gaps": gaps,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


def _peak_flops(device) -> float | None:
    """The device's dense bf16 peak FLOP/s from zbcompile's hardware profiles (H100 and H200:
    989 TFLOP/s), None where no profile names it."""
    import torch

    from zbcompile.planner.hardware import NAMED

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, hardware in NAMED.items():
        if key.split("-")[0] in name:
            return hardware.flops
    return None


# --- the report -----------------------------------------------------------------------------


def report(parts: list[dict]) -> str:
    if not parts:
        return "# Stage programs on one GPU against the model without us\n\nNo part finished.\n"
    head = parts[0]
    lines = [
        "# Stage programs on one GPU against the model without us",
        "",
        f"Device: {head['device']}; torch {head['torch']}; bf16 weights and activations, flash attention "
        "(scaled_dot_product_attention). One process holds every stage (the local runner): the "
        "stage programs' cost against the model itself, not pipelining's gain. Default options "
        "(zb-auto) besides `compiler`. Rounds alternate (order reversed every other round), steps back "
        "to back, device synchronised around a round only; medians over rounds.",
        "",
    ]
    rows = []
    for d in parts:
        p, mfu, tokens = d["part"], d["mfu"] or {}, d["tokens_per_s"]
        baseline = "eager model" if p["compiler"] == "eager" else "torch.compile(model)"
        rows.append([
            p["model"], f"{d['parameters'] / 1e9:.2f}B",
            f"{p['stages']} / {p['microbatches']} x {p['rows']} x {p['seq_len']}",
            baseline, f"{tokens['baseline']:,.0f}", _pct(mfu.get("baseline")),
            f"pipe.step ({p['compiler']})", f"{tokens['pipeline']:,.0f}", _pct(mfu.get("pipeline")),
            f"{d['pipeline_over_baseline']:.3f}x",
            f"{d['first_step_s']['baseline']:.1f} / {d['first_step_s']['pipeline']:.1f}",
        ])
    lines.append(_launch.table(
        ["model", "params", "stages / m x rows x seq", "baseline", "tokens/s", "MFU", "ours", "tokens/s", "MFU",
         "ours / baseline", "first step s (baseline / ours)"],
        rows,
    ))
    lines += ["", "## Per-action overhead (pipeline, last timed step, CUDA events)", ""]
    gaps = [d["action_gaps"] for d in parts]
    lines.append(_launch.table(
        ["model", "compiler", "actions", "busy ms", "span ms", "mean gap ms", "max gap ms",
         "mean gap before (by kind)"],
        [
            [d["part"]["model"], d["part"]["compiler"], g["actions"], g["busy_ms"], g["span_ms"], g["mean_gap_ms"],
             g["max_gap_ms"], ", ".join(f"{k} {v}" for k, v in g["mean_gap_ms_before"].items())]
            for d, g in zip(parts, gaps)
        ],
    ))
    lines += [
        "",
        "A gap is the device's idle time between the end of one action and the start of the next "
        "(the host had not queued it yet); with the host ahead of the device it is zero.",
        "",
        "## Published MFU for comparison (bf16)",
        "",
        _launch.table(
            ["run", "MFU"], [[name, _pct(paper_mfu()) if value == "paper" else value] for name, value in PUBLISHED_MFU]
        ),
        "",
        "The paper's MFU is derived from its Table 4 throughput with its Table 1 FLOPs per layer and "
        "the LM head's 6shV over the A100's 312 TFLOP/s; ours uses the compile's FLOP count over "
        "989 TFLOP/s (H100/H200 dense bf16).",
    ]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--compiler", choices=COMPILERS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models, few steps: every code path on any device")
    parser.add_argument("--out", default=None, help="folder for the part's JSON line and kernel table")
    parser.add_argument("--report", default=None, help="write benchmarks/results/gpu_throughput.* from this folder")
    options = parser.parse_args()
    if options.report:
        lines = pathlib.Path(options.report, "gpu_throughput.jsonl").read_text().splitlines()
        parts = [json.loads(line) for line in lines if line.strip()]
        on_device = bool(parts) and parts[0]["device"] != "cpu"
        _launch.print_and_write("gpu_throughput", {"parts": parts}, report(parts), on_device)
        return 0
    if options.model is None or options.compiler is None:
        parser.error("give --model and --compiler (one part), or --report DIR")
    import torch

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu --tiny to check the script)")
        return 0
    part = Part(options.model, options.compiler)
    if options.tiny:
        part = replace(part, tiny=True, seq_len=32, rows=2, microbatches=4, warmup=3, rounds=2, steps_per_round=1)
    out_dir = pathlib.Path(options.out or _launch.RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = run_part(part, options.device, out_dir)
    print(json.dumps(data, indent=1))
    with open(out_dir / "gpu_throughput.jsonl", "a") as f:
        f.write(json.dumps(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
