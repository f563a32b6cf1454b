"""Pipelines built one after another on a tensor-parallel mesh, launch after launch: on 4 gloo
ranks over a ("pp", "tp") = (2, 2) DeviceMesh (with `--eight`, then once on 8 over ("dp", "pp",
"tp") = (2, 2, 2)), a transformers Llama with torchtitan's plan given as `tensor_parallel=`,
and in one process, for each of 1f1b, zb-h1, zb-auto and zbv, a new pipeline with the default
options, compiled, stepped 3 times with AdamW and compared with eager over the whole batch
(tests/helpers/tensor_parallel_workers.py, as tests/runtime/test_tensor_parallel.py runs it once).
Every launch must finish within `--timeout` and equal eager. Run it beside the test suite for a
CI-like load. Writes benchmarks/results/successive_pipelines.{json,md}.

    python benchmarks/successive_pipelines.py [--runs 20] [--eight] [--timeout 900]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from _launch import load_line, machine, table, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers import tensor_parallel_workers as workers  # noqa: E402
from helpers.multiprocess import run_ranks  # noqa: E402

LAYOUTS = {4: {"pp": 2, "tp": 2}, 8: {"dp": 2, "pp": 2, "tp": 2}}


def launch(world: int, timeout_s: float) -> dict:
    """One launch: whether it finished and equals eager, its seconds and, if not, why."""
    started = time.perf_counter()
    outcome = "equal to eager"
    try:
        # train(name, sizes, data_parallel, schedules, dump, clipped, successive)
        per_rank = run_ranks(world, workers.train, "llama", LAYOUTS[world], "replicate", workers.SCHEDULES, None,
                             False, True, timeout=timeout_s)
        workers.check_equals_eager([{"llama": r} for r in per_rank], ("llama",))
    except Exception:  # noqa: BLE001 - reported
        outcome = traceback.format_exc()[-3000:]
    return {"ranks": world, "seconds": time.perf_counter() - started, "outcome": outcome}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="four-rank launches")
    parser.add_argument("--eight", action="store_true", help="then one eight-rank launch")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before it counts as hung")
    args = parser.parse_args()
    info = machine()
    results = []
    for run in range(args.runs + int(args.eight)):
        result = {"run": run, **launch(8 if run == args.runs else 4, args.timeout)}
        results.append(result)
        print(f"run {run} ({result['ranks']} ranks): {result['outcome'].splitlines()[-1]} in "
              f"{result['seconds']:.1f} s", flush=True)
    failed = [r for r in results if r["outcome"] != "equal to eager"]
    for r in failed:
        print(f"\n--- run {r['run']} ---\n{r['outcome']}")
    summary = f"{len(results) - len(failed)} of {len(results)} launches finished, each equal to eager"
    print("\n" + summary)
    rows = [[r["run"], r["ranks"], r["outcome"].splitlines()[-1][:80], f"{r['seconds']:.1f}"] for r in results]
    markdown = "\n\n".join([
        "# Successive pipelines (1f1b, zb-h1, zb-auto, zbv) on a tensor-parallel mesh",
        load_line(info), summary, table(["run", "ranks", "outcome", "seconds"], rows),
    ])
    write_results("successive_pipelines", {"machine": info, "results": results, "failed": len(failed)},
                  markdown + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
