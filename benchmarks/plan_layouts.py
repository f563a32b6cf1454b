"""`zbcompile plan` on large configs no test contains, as a user sizing a run asks it, each in
its own process (wall time and peak memory of that process recorded):

- Mixtral-8x7B at pp=8, dp=4 (replicate), m=32, 4096 tokens, H100-80GB: the whole menu (V-Half,
  V-Min, ZBV, zb-auto in-line and over a V, ZB-H1, ZB-H2, 1F1B, each with and without
  recomputation) with memory and fit, and the fastest that fits;
- Qwen2-72B and Llama-3-70B at pp=8, dp=8 (replicate), m=32: nothing fits; the plan names the
  nearest layouts (searched within its time budget);
- Qwen2-72B and Llama-3-70B over 64 GPUs, global batch 256 x 4096 tokens: the layout searched.

    python benchmarks/plan_layouts.py            # ~8 minutes of CPU
    python benchmarks/plan_layouts.py --quick    # the Mixtral menu only

Writes benchmarks/results/plan_layouts.{json,md}. Predictions, not timings: the plans do not
depend on the machine's load (the seconds and bytes the planner takes do).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import _launch

CONFIGS = pathlib.Path(__file__).parent / "configs"
CASES = [
    # (label, config, arguments)
    ("Mixtral-8x7B, pp=8 dp=4 replicate, m=32", "mixtral-8x7b.json", ["--stages", "8", "--dp", "4",
                                                                       "--microbatches", "32"]),
    ("Qwen2-72B, pp=8 dp=8 replicate, m=32", "qwen2-72b.json", ["--stages", "8", "--dp", "8", "--microbatches", "32"]),
    ("Llama-3-70B, pp=8 dp=8 replicate, m=32", "llama3-70b.json", ["--stages", "8", "--dp", "8",
                                                                    "--microbatches", "32"]),
    ("Qwen2-72B over 64 GPUs, global batch 256", "qwen2-72b.json", ["--gpus", "64", "--global-batch", "256"]),
    ("Llama-3-70B over 64 GPUs, global batch 256", "llama3-70b.json", ["--gpus", "64", "--global-batch", "256"]),
]


def run_case(config: str, arguments: list[str]) -> dict:
    """`zbcompile plan` in a child process: its record, printed report, wall seconds, peak RSS."""
    with tempfile.TemporaryDirectory() as root:
        record_path = os.path.join(root, "record.json")
        command = [sys.executable, "-m", "zbcompile.cli", "plan", str(CONFIGS / config), "--seq-len", "4096",
                   *arguments, "--json", record_path]
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    return {"exit": os.waitstatus_to_exitcode(status), "seconds": seconds,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "record": record, "output": output}


def summary(label: str, result: dict) -> list[str]:
    record = result["record"]
    head = (f"### {label}\n\nplanned in {result['seconds']:.0f} s ({result['cpu_seconds']:.0f} s of CPU), "
            f"peak {result['peak_rss_bytes'] / 1e9:.2f} GB")
    lines = [head, ""]
    if "menu" in record:
        choice = record["menu_choice"]
        lines.append(f"fastest that fits: {choice['schedule']} (recompute {choice['recompute']}), steady step "
                     f"{choice['step']:.3f} s" if choice else "nothing on the menu fits")
        rows = [[e["schedule"], e["recompute"], f"{e['peak_bytes'] / 1e9:.1f}" if e.get("peak_bytes") else "-",
                 "yes" if e["fits"] else "no", f"{e['step']:.3f}" if e.get("error") is None else e["error"][:60]]
                for e in record["menu"]]
        lines += ["", _launch.table(["schedule", "recompute", "peak GB", "fits", "steady step s"], rows)]
        for near in record.get("nearest") or []:
            lines.append(f"- nearest that fits: pp={near['pp']} tp={near['tp']} dp={near['dp']} "
                         f"({near['data_parallel']}), {near['microbatches']} x {near['microbatch_size']}, "
                         f"{near['schedule']} (recompute {near['recompute']}): {near['step']:.3f} s")
        if (record.get("nearest_budget") or {}).get("stopped"):
            lines.append(f"- the nearest layouts' search stopped at its time budget: "
                         f"{record['nearest_budget']['layouts_skipped']} layouts not priced")
    if "layouts" in record:
        rows = [[o["pp"], o["tp"], o["dp"], o["data_parallel"], f"{o['microbatches']} x {o['microbatch_size']}",
                 o["schedule"], o["recompute"], f"{o['step']:.3f}", f"{o['tokens_per_s']:.0f}", f"{o['mfu']:.1%}",
                 f"{o['peak_bytes'] / 1e9:.1f}"] for o in record["layouts"]]
        lines += [_launch.table(["pp", "tp", "dp", "data-parallel", "microbatches", "schedule", "recompute",
                                 "step s", "tokens/s", "MFU", "peak GB"], rows), "",
                  f"{record['options']} options, {record['priced']} priced, {record['pruned']} spared by the bound; "
                  f"search {record['seconds']:.0f} s of the {result['seconds']:.0f} s"]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the Mixtral menu only")
    options = parser.parse_args()
    results = []
    for label, config, arguments in CASES[:1] if options.quick else CASES:
        print(f"planning {label} ...", flush=True)
        result = run_case(config, arguments)
        print(result["output"][-4000:], flush=True)
        results.append({"label": label, "config": config, "arguments": arguments, **result})
    text = "\n".join(["# `zbcompile plan`: the menu under a memory limit, and the layout searched", "",
                      *(line for r in results for line in summary(r["label"], r))])
    print(text)
    if not options.quick:
        _launch.write_results("plan_layouts", {"machine": _launch.machine(), "results": results}, text)


if __name__ == "__main__":
    main()
