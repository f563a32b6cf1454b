"""Cost of splitting a stage's backward into I (input gradients) and W (weight gradients):
(T_B + T_W) / T_(unsplit backward) for one stage at 32, 128 and 512 rows per microbatch.

zbcompile: the stage's compiled backward graph against its I graph followed by its W graph, on
the same saved values (`zbcompile.compiler.compile_pipeline`, then the stage programs run
directly). torch.distributed.pipelining: the same stage module in eager mode, its autograd-graph
split (`_backward.stage_backward_input` then `stage_backward_weight`, what its zero-bubble
schedules run) against one plain `torch.autograd.backward`.

The stage is the second of a 2-stage pipeline: residual MLP blocks (LayerNorm, Linear h->4h,
GELU, Linear 4h->h) and a Linear head, ending in the MSE loss; rows = the leading dimension of
the stage's input [rows, hidden]. One thread; all four variants alternate within every repeat
(the order rotates); medians.

    python benchmarks/split_overhead.py [--hidden 256 --layers 4 --repeats 100]

Writes benchmarks/results/split_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import _launch
import _pairing

ROWS = (32, 128, 512)
TORCH_REPORTED = {32: 1.30, 128: 1.17, 512: 1.04}  # torch's split, measured earlier on a 2-core CPU


@dataclass(frozen=True)
class Settings:
    hidden: int = 256
    layers: int = 4
    rows: tuple[int, ...] = ROWS
    repeats: int = 100
    warmup: int = 3
    threads: int = 1


class ResidualMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


def build_model(settings: Settings) -> nn.Sequential:
    """Stage 0: one Linear; stage 1 (measured): the residual MLP blocks and a Linear head."""
    torch.manual_seed(0)
    h = settings.hidden
    stage = nn.Sequential(*[ResidualMLP(h) for _ in range(settings.layers)], nn.Linear(h, h))
    return nn.Sequential(nn.Linear(h, h), stage)


# --- zbcompile -------------------------------------------------------------------------------


class Ours:
    """The compiled stage 1: forward once, then the unsplit backward or I + W on the same values."""

    def __init__(self, model: nn.Sequential, rows: int, hidden: int) -> None:
        from zbcompile.compiler import compile_pipeline
        from zbcompile.passes.graph_cost import random_inputs
        from zbcompile.value_names import buffer_name, output_name, param_name, tangent_name

        x = torch.randn(rows, hidden)
        compiled = compile_pipeline(model, F.mse_loss, (x,), {}, torch.randn(rows, hidden), 2, ["1"])
        self.program = program = compiled.programs[1]
        self.state = {param_name(n): p.detach() for n, p in model.named_parameters()}
        self.state.update({buffer_name(n): b for n, b in model.named_buffers()})
        env = random_inputs(program.forward, self.state, torch.Generator().manual_seed(rows))
        with torch.no_grad():
            program.forward.run(env, self.state)
        for name in program.joint.tangents:
            value = env.get(output_name(name), env.get(name))
            env[tangent_name(name)] = torch.ones((), dtype=torch.float32) if name == "loss" else torch.randn_like(value)
        self.env = env
        self.check()

    def unsplit(self) -> float:
        env = dict(self.env)
        with torch.no_grad():
            started = time.perf_counter()
            self.program.joint.backward.run(env, self.state)
            return time.perf_counter() - started

    def split(self) -> tuple[float, float]:
        env = dict(self.env)
        with torch.no_grad():
            started = time.perf_counter()
            self.program.input_backward.run(env, self.state)
            middle = time.perf_counter()
            self.program.weight_backward.run(env, self.state)
            return middle - started, time.perf_counter() - middle

    def check(self) -> None:
        """I then W gives the unsplit backward's gradients (so the timing compares like with like)."""
        a, b = dict(self.env), dict(self.env)
        with torch.no_grad():
            self.program.joint.backward.run(a, self.state)
            self.program.input_backward.run(b, self.state)
            self.program.weight_backward.run(b, self.state)
        for name in self.program.joint.backward.signature.outputs:
            if not torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"I + W differs from the unsplit backward in {name}")


# --- torch.distributed.pipelining's autograd split ------------------------------------------------


class Theirs:
    """The same stage module in eager mode; a fresh forward (untimed) before every backward."""

    def __init__(self, model: nn.Sequential, rows: int, hidden: int) -> None:
        self.module = model[1]
        generator = torch.Generator().manual_seed(rows)
        self.x = torch.randn(rows, hidden, generator=generator)
        self.target = torch.randn(rows, hidden, generator=generator)

    def _forward(self):
        x = self.x.clone().requires_grad_(True)
        loss = F.mse_loss(self.module(x), self.target)
        return x, loss

    def unsplit(self) -> float:
        self.module.zero_grad(set_to_none=True)
        x, loss = self._forward()
        started = time.perf_counter()
        torch.autograd.backward(loss)
        return time.perf_counter() - started

    def split(self) -> tuple[float, float]:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        self.module.zero_grad(set_to_none=True)
        x, loss = self._forward()
        started = time.perf_counter()
        _, param_groups = stage_backward_input([loss], None, [x], self.module.parameters())
        middle = time.perf_counter()
        stage_backward_weight(self.module.parameters(), param_groups)
        return middle - started, time.perf_counter() - middle


def measure(settings: Settings, rows: int) -> dict:
    model = build_model(settings)
    ours, theirs = Ours(model, rows, settings.hidden), Theirs(model, rows, settings.hidden)
    runs = {
        "ours_unsplit": ours.unsplit, "ours_split": ours.split, "torch_unsplit": theirs.unsplit,
        "torch_split": theirs.split,
    }
    for _ in range(settings.warmup):
        for fn in runs.values():
            fn()
    gc.collect()
    gc.disable()
    try:
        samples = _pairing.rounds(runs, settings.repeats, lambda name: runs[name](), rotate=True)
    finally:
        gc.enable()
    med = _launch.median
    result = {"rows": rows}
    for lib in ("ours", "torch"):
        unsplit = med(samples[f"{lib}_unsplit"])
        b = med([s[0] for s in samples[f"{lib}_split"]])
        w = med([s[1] for s in samples[f"{lib}_split"]])
        total = med([s[0] + s[1] for s in samples[f"{lib}_split"]])
        # the ratio within each repeat (unsplit and split ran side by side), then the median
        paired = med([(s[0] + s[1]) / u for s, u in zip(samples[f"{lib}_split"], samples[f"{lib}_unsplit"])])
        result[lib] = {
            "unsplit_ms": 1e3 * unsplit, "b_ms": 1e3 * b, "w_ms": 1e3 * w, "b_plus_w_ms": 1e3 * total,
            "ratio": total / unsplit, "ratio_paired": paired, "w_share": w / (b + w) if b + w > 0 else float("nan"),
        }
    return result


def measure_all(settings: Settings) -> list[dict]:
    """`measure` at every row count of `settings`, each printed as it ends."""
    results = []
    for rows in settings.rows:
        results.append(measure(settings, rows))
        ours, theirs = results[-1]["ours"]["ratio"], results[-1]["torch"]["ratio"]
        print(f"rows {rows}: ours {ours:.3f}, torch {theirs:.3f}", flush=True)
    return results


def analyse(results: list[dict], settings: Settings) -> dict:
    holds = all(r["ours"]["ratio"] <= 1.05 for r in results)
    return {"torch_reported": TORCH_REPORTED, "results": results, "target": {"ours_max_ratio": 1.05, "holds": holds}}


def report(data: dict) -> str:
    s = data["settings"]
    lines = [
        "# I/W split overhead: (T_B + T_W) / T_unsplit for one stage",
        "",
        f"Stage: {s['layers']} residual MLP blocks (hidden {s['hidden']}, LayerNorm, Linear h->4h, GELU, Linear 4h->h) "
        f"and a Linear head with the MSE loss, the second stage of a 2-stage pipeline; fp32, {s['threads']} thread(s); "
        f"{s['warmup']} warm-up and {s['repeats']} alternating repeats of the four variants; medians.",
        f"Machine: {_launch.before_after(data)}.",
        "",
    ]
    rows = [
        [r["rows"], *_cells(r["ours"]), *_cells(r["torch"]), f"{TORCH_REPORTED.get(r['rows'], float('nan')):.2f}"]
        for r in data["results"]
    ]
    lines.append(_launch.table(
        ["rows", "ours unsplit ms", "ours I + W ms", "ours ratio", "ours paired", "torch unsplit ms", "torch I + W ms",
         "torch ratio", "torch paired", "torch earlier"],
        rows,
    ))
    lines += [
        "",
        "ratio: median(T_B + T_W) / median(T_unsplit); paired: the median of the per-repeat ratios. "
        "torch earlier: torch's split as measured before on this kind of machine.",
        "",
        "## Target: ours at most 1.05 at every size",
        "",
    ]
    lines.append(_launch.table(
        ["rows", "ours ratio", "holds"],
        [[r["rows"], f"{r['ours']['ratio']:.3f}", "yes" if r["ours"]["ratio"] <= 1.05 else "NO"]
         for r in data["results"]],
    ))
    return "\n".join(lines)


def _cells(times: dict) -> list[str]:
    """One library's columns of a row: unsplit ms, I + W ms, the ratio and the paired ratio."""
    return [
        f"{times['unsplit_ms']:.2f}", f"{times['b_ms']:.2f} + {times['w_ms']:.2f}", f"{times['ratio']:.3f}",
        f"{times['ratio_paired']:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--layers", type=int, default=Settings.layers)
    parser.add_argument("--repeats", type=int, default=Settings.repeats)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results files alone")
    options = parser.parse_args()
    settings = Settings(hidden=options.hidden, layers=options.layers, repeats=options.repeats, rows=tuple(options.rows))
    torch.set_num_threads(settings.threads)
    _launch.run_and_report("split_overhead", None, measure_all, settings, analyse, report, not options.no_write)


if __name__ == "__main__":
    main()
