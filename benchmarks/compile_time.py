"""Compile time against depth, beside torch.export of the same forward, in one run: a transformers
Llama (hidden 256, 4 heads, 2 key/value heads, batch 2 x 64 tokens) with 4, 16, 32 and 64
layers cut into 4 stages, each timed as

    export      torch.export.export(model, ..., strict=False) of its forward with the loss
    compile     compiler.compile_pipeline: every stage traced, partitioned, joint, split, costed
    costs       compiler.compile_costs: the same costs, identical stages compiled once (what plan() runs)

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


def measure(layers: int) -> dict:
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
    compiled, compile_wall, compile_cpu = timed(lambda: compile_pipeline(model, None, (tokens,), {"labels": tokens}, None, 4))
    costed, costs_wall, costs_cpu = timed(lambda: compile_costs(model, None, (tokens,), {"labels": tokens}, None, 4))
    same = costed.costs == tuple(p.cost for p in compiled.programs)
    return {
        "layers": layers, "export_s": export_wall, "export_cpu_s": export_cpu, "compile_s": compile_wall,
        "compile_cpu_s": compile_cpu, "costs_s": costs_wall, "costs_cpu_s": costs_cpu,
        "compile_phases_s": compiled.phase_seconds, "costs_phases_cpu_s": costed.phase_cpu_seconds,
        "reused_stages": [s for s, r in enumerate(costed.representative) if r != s], "costs_equal": same,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, action="append", default=None)
    args = parser.parse_args()
    results = [measure(n) for n in (args.layers or [4, 16, 32, 64])]
    lines = [
        "| layers | export s (CPU) | compile s (CPU) | compile / export (CPU) | costs s (CPU) | costs / export (CPU) | reused stages | costs equal | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['layers']} | {r['export_s']:.1f} ({r['export_cpu_s']:.1f}) | {r['compile_s']:.1f} ({r['compile_cpu_s']:.1f}) | "
            f"{r['compile_cpu_s'] / r['export_cpu_s']:.1f}x | {r['costs_s']:.1f} ({r['costs_cpu_s']:.1f}) | "
            f"{r['costs_cpu_s'] / r['export_cpu_s']:.1f}x | {r['reused_stages']} | {r['costs_equal']} | {r['load_average']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(__file__).parent / "results"
    (out / "compile_time.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "compile_time.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
