"""`zbcompile plan` of a Llama-3-70B-class config (benchmarks/configs/llama3-70b.json: 80 layers,
hidden 8192, 64 heads, 8 key/value heads) in one CPU process, for pp=8 and pp=16, dp=8, 32
microbatches of one 4096-token sequence, against an 80 GB H100: each run's wall time, CPU time
and peak resident memory (of the child process, from `resource`), and the report's schedule
lines. Writes benchmarks/results/plan_scale.{json,md} (with the load average beside the times:
on a shared machine wall time is not the process's own; CPU time is). With `--tp 8`, each stage
on 8 tensor-parallel ranks too (transformers' own plan for the Llama), written to
plan_scale_tp8.{json,md}.

    PYTHONPATH=. python benchmarks/plan_scale.py [--stages 8] [--tp 8]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import subprocess
import sys
import time

import _launch

HERE = pathlib.Path(__file__).parent
CONFIG = HERE / "configs" / "llama3-70b.json"


def run(stages: int, tp: int = 1) -> dict:
    command = [
        sys.executable, "-m", "zbcompile.cli", "plan", str(CONFIG), "--stages", str(stages), "--microbatches", "32",
        "--dp", "8", "--tp", str(tp), "--seq-len", "4096", "--hardware", "H100-80GB",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "stages": stages, "tp": tp, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": after.ru_maxrss / 1024,
        "load_average_before": load, "load_average_after": os.getloadavg()[0], "report": done.stdout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, action="append", default=None)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    args = parser.parse_args()
    results = [run(s, args.tp) for s in (args.stages or [8, 16])]
    lines = [
        "| pp | wall (s) | CPU (s) | peak RSS (MB) | load average (1 min) before, after |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['stages']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_mb']:.0f} | "
            f"{r['load_average_before']:.1f}, {r['load_average_after']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    for r in results:
        print(f"\n--- pp={r['stages']} ---\n{r['report']}")
    name = "plan_scale" if args.tp == 1 else f"plan_scale_tp{args.tp}"
    note = (
        "CPU time is the planning process's own (user + system), the best guide to its wall time on a quiet "
        "machine; wall time here depends on the load beside it.\n\n"
    )
    reports = "\n\n".join(f"pp={r['stages']}:\n```\n{r['report']}```" for r in results)
    _launch.write_results(name, results, note + table + "\n\n" + reports, indent=1)


if __name__ == "__main__":
    main()
