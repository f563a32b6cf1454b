"""Exit codes of the examples under torchrun, run after run: `examples/finetune_llama.py` on 2
ranks with evaluation and a checkpoint every 2 steps, 4 steps, then `--resume` to 6 (the
conditions of tests/e2e/test_entry_points.py), in `--loops` launch loops side by side (two: a
CI-like load, as two test suites at once), each through tests/helpers/exit_check.py. Every run
must exit with code 0, print no "terminate called" (an abort at interpreter exit, exit code -6
or 134) and leave no gloo or transport thread alive on any rank as Python finalizes (what could
abort it). Prints each failure's output tail and a summary, and writes
benchmarks/results/clean_exits.{json,md}.

    python benchmarks/clean_exits.py [--runs 20] [--loops 2] [--quick]

`--runs` counts pairs (first run and resumed run) per loop; `--quick`: 2 pairs, one loop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from _launch import free_port, load_line, machine, table, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "finetune_llama.py")
EXIT_CHECK = os.path.join(ROOT, "tests", "helpers", "exit_check.py")
COMMON = ["--eval-every", "2", "--checkpoint-every", "2"]
ABORT = "terminate called"


def launch(arguments: list[str], directory: str, port: int, timeout_s: float) -> dict:
    """One torchrun launch of the example on 2 ranks: its exit code, seconds and output tail."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(port), EXIT_CHECK, EXAMPLE, *COMMON,
               "--checkpoint-dir", os.path.join(directory, "ckpt"), "--out", os.path.join(directory, "losses.png"),
               *arguments]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = "timeout", f"{expired.stdout or ''}{expired.stderr or ''}"
    clean = all(f"exit check, rank {rank}: no threads left" in output for rank in range(2))
    return {"code": code, "aborted": ABORT in output, "threads_left": not clean,
            "seconds": time.perf_counter() - started, "tail": output[-3000:]}


def loop(index: int, runs: int, timeout_s: float) -> list[dict]:
    """`runs` pairs (4 steps, then --resume to 6) in a directory of their own."""
    port = free_port()
    results = []
    for run in range(runs):
        directory = tempfile.mkdtemp(prefix=f"zbcompile-exits-{index}-")
        try:
            for name, arguments in (("first", ["--steps", "4"]), ("resumed", ["--steps", "6", "--resume"])):
                result = {"loop": index, "run": run, "launch": name, **launch(arguments, directory, port, timeout_s)}
                results.append(result)
                print(f"loop {index} run {run} {name}: exit code {result['code']}"
                      f"{' (' + ABORT + ')' if result['aborted'] else ''}"
                      f"{', threads left at exit' if result['threads_left'] else ''} in {result['seconds']:.1f} s",
                      flush=True)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="pairs of launches per loop")
    parser.add_argument("--loops", type=int, default=2, help="launch loops side by side")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--quick", action="store_true", help="2 pairs, one loop")
    args = parser.parse_args()
    runs, loops = (2, 1) if args.quick else (args.runs, args.loops)
    info = machine()
    with ThreadPoolExecutor(loops) as pool:
        results = [r for part in pool.map(lambda i: loop(i, runs, args.timeout), range(loops)) for r in part]
    failed = [r for r in results if r["code"] != 0 or r["aborted"] or r["threads_left"]]
    for r in failed:
        print(f"\n--- loop {r['loop']} run {r['run']} {r['launch']}: exit code {r['code']} ---\n{r['tail']}")
    summary = (f"{len(results) - len(failed)} of {len(results)} launches exited cleanly "
               f"({loops} loop(s) side by side, {runs} pairs each)")
    print("\n" + summary)
    rows = [[r["loop"], r["run"], r["launch"], r["code"], "yes" if r["aborted"] else "no",
             "yes" if r["threads_left"] else "no", f"{r['seconds']:.1f}"] for r in results]
    markdown = "\n\n".join([
        "# Exit codes of examples/finetune_llama.py under torchrun",
        load_line(info),
        summary,
        table(["loop", "run", "launch", "exit code", ABORT, "threads left at exit", "seconds"], rows),
    ])
    write_results("clean_exits", {"machine": info, "results": results, "failed": len(failed)}, markdown + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
