"""Compile time against depth, beside torch.export of the same forward, in one run: a transformers
Llama (hidden 256, 4 heads, 2 key/value heads, batch 2 x 64 tokens) with 16, 32 and 64 layers
cut into 4 stages, each timed as

    export      torch.export.export(model, ..., strict=False) of its forward with the loss
    compile     compiler.compile_pipeline as `pipeline()` runs it: every stage traced,
                partitioned, joint (assembled from its blocks' joints, each distinct block
                traced once: `passes/block_joint.py`), split, costed
    + stages    compile_pipeline(reuse_stages=True): identical stages compiled once besides
                (with --stages only)
    costs       compiler.compile_costs: the costs only (what plan() runs)
    no blocks   compile_pipeline(reuse_blocks=False): every stage's joint traced whole
                (with --whole only)

in CPU seconds (the process's own; a shared machine distorts wall-clock time), with the compile's
phases: the whole-model forward trace (`trace`, which grows with depth as export does) against
the rest. Prints a table and writes benchmarks/results/compile_time.{json,md}.

    PYTHONPATH=. python benchmarks/compile_time.py [--layers 16 --layers 64] [--whole] [--stages]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import _launch
from zbcompile.compiler import compile_costs, compile_pipeline

transformers.logging.set_verbosity_error()


def timed(fn) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def measure(layers: int, whole: bool = False, stages: bool = False) -> dict:
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    tokens = torch.randint(0, 512, (2, 64))
    load = os.getloadavg()[0]
    _, export_wall, export_cpu = timed(
        lambda: torch.export.export(model, (tokens,), {"labels": tokens}, strict=False)
    )
    batch = (model, None, (tokens,), {"labels": tokens}, None, 4)
    result = {"layers": layers, "export_s": export_wall, "export_cpu_s": export_cpu}
    compiled, result["compile_s"], result["compile_cpu_s"] = timed(lambda: compile_pipeline(*batch))
    result["compile_phases_cpu_s"] = compiled.phase_cpu_seconds
    if stages:
        _, result["stages_s"], result["stages_cpu_s"] = timed(lambda: compile_pipeline(*batch, reuse_stages=True))
    costed, result["costs_s"], result["costs_cpu_s"] = timed(lambda: compile_costs(*batch))
    result["costs_phases_cpu_s"] = costed.phase_cpu_seconds
    result["reused_stages"] = [s for s, r in enumerate(costed.representative) if r != s]
    if whole:
        plain, result["whole_s"], result["whole_cpu_s"] = timed(lambda: compile_pipeline(*batch, reuse_blocks=False))
        result["whole_phases_cpu_s"] = plain.phase_cpu_seconds
        result["programs_equal"] = all(
            a.forward.graph.code == b.forward.graph.code
            and a.input_backward.graph.code == b.input_backward.graph.code
            and a.weight_backward.graph.code == b.weight_backward.graph.code
            and a.cost == b.cost
            for a, b in zip(compiled.programs, plain.programs, strict=True)
        )
    result["load_average"] = (load, os.getloadavg()[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, action="append", default=None)
    parser.add_argument("--whole", action="store_true", help="also compile with every stage's joint traced whole")
    parser.add_argument("--stages", action="store_true", help="also compile with identical stages compiled once")
    args = parser.parse_args()
    results = [measure(n, args.whole, args.stages) for n in (args.layers or [16, 32, 64])]
    lines = [
        "| layers | export CPU s | compile CPU s | compile / export | trace | rest | + stages CPU s | costs CPU s "
        "| no blocks CPU s | load before, after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        phases = r["compile_phases_cpu_s"]
        trace = phases["trace"]
        whole = f"{r['whole_cpu_s']:.1f}" if "whole_cpu_s" in r else "-"
        stages = f"{r['stages_cpu_s']:.1f}" if "stages_cpu_s" in r else "-"
        lines.append(
            f"| {r['layers']} | {r['export_cpu_s']:.1f} | {r['compile_cpu_s']:.1f} | "
            f"{r['compile_cpu_s'] / r['export_cpu_s']:.2f}x "
            f"| {trace:.1f} | {sum(phases.values()) - trace:.1f} | {stages} | {r['costs_cpu_s']:.1f} | {whole} "
            f"| {r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} |"
        )
    by_layers = {r["layers"]: r for r in results}
    if 16 in by_layers and 64 in by_layers:
        a, b = by_layers[16], by_layers[64]
        lines.append("")
        lines.append(
            f"64 layers against 16 (CPU): compile {b['compile_cpu_s'] / a['compile_cpu_s']:.2f}x, "
            f"export {b['export_cpu_s'] / a['export_cpu_s']:.2f}x, "
            f"trace {b['compile_phases_cpu_s']['trace'] / a['compile_phases_cpu_s']['trace']:.2f}x"
        )
    table = "\n".join(lines)
    print(table)
    _launch.write_results("compile_time", results, table, indent=1)


if __name__ == "__main__":
    main()
