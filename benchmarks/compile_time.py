"""Compile time against depth, beside torch.export of the same forward, in one run: a transformers
Llama (hidden 256, 4 heads, 2 key/value heads, batch 2 x 64 tokens) with 4, 16, 32 and 64
layers cut into 4 stages, each timed as

    export      torch.export.export(model, ..., strict=False) of its forward with the loss
    compile     compiler.compile_pipeline: every stage traced, partitioned, joint, split, costed
                (left out with --skip-full)
    reuse       compile_pipeline(reuse_stages=True): identical stages compiled once, each under
                its own names
    costs       compiler.compile_costs: the costs only (what plan() runs)

in wall-clock and CPU seconds (the process's own: a shared machine distorts only the first), and
the phases of each. Prints a table and writes benchmarks/results/compile_time.{json,md}.

    PYTHONPATH=. python benchmarks/compile_time.py [--layers 4 --layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch
import transformers

from zbcompile.compiler import compile_costs, compile_pipeline

transformers.logging.set_verbosity_error()


def timed(fn) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def measure(layers: int, full: bool = True) -> dict:
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    tokens = torch.randint(0, 512, (2, 64))
    _, export_wall, export_cpu = timed(
        lambda: torch.export.export(model, (tokens,), {"labels": tokens}, strict=False)
    )
    batch = (model, None, (tokens,), {"labels": tokens}, None, 4)
    result = {"layers": layers, "export_s": export_wall, "export_cpu_s": export_cpu}
    if full:
        compiled, result["compile_s"], result["compile_cpu_s"] = timed(lambda: compile_pipeline(*batch))
    shared, result["reuse_s"], result["reuse_cpu_s"] = timed(lambda: compile_pipeline(*batch, reuse_stages=True))
    costed, result["costs_s"], result["costs_cpu_s"] = timed(lambda: compile_costs(*batch))
    result["reuse_phases_s"] = shared.phase_seconds
    result["reused_stages"] = [s for s, r in enumerate(costed.representative) if r != s]
    result["costs_equal"] = costed.costs == tuple(p.cost for p in shared.programs)
    result["load_average"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, action="append", default=None)
    parser.add_argument("--skip-full", action="store_true", help="leave out compile_pipeline without reuse")
    args = parser.parse_args()
    results = [measure(n, not args.skip_full) for n in (args.layers or [4, 16, 32, 64])]
    lines = [
        "| layers | export s (CPU) | compile s (CPU) | reuse s (CPU) | reuse / export (CPU) | costs s (CPU) | reused stages | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        full = f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f})" if "compile_s" in r else "-"
        lines.append(
            f"| {r['layers']} | {r['export_s']:.1f} ({r['export_cpu_s']:.1f}) | {full} | {r['reuse_s']:.1f} ({r['reuse_cpu_s']:.1f}) | "
            f"{r['reuse_cpu_s'] / r['export_cpu_s']:.1f}x | {r['costs_s']:.1f} ({r['costs_cpu_s']:.1f}) | {r['reused_stages']} | "
            f"{r['load_average']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(__file__).parent / "results"
    (out / "compile_time.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "compile_time.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
