"""Plans rehearsed: does `zbcompile rehearse plan.json` reproduce what the plan priced?

Held-out models (benchmarks/fixtures/rehearse_plans/: configs of models the planner was not
tuned on, a Llama-style 34B, a Qwen2-style 14B and a small Mixtral-style MoE) are planned at pp=8,
m=32 with data parallelism (`zbcompile plan --json`, one CPU process each; a record already in
`--plans` is reused), then rehearsed on this machine: every schedule the plan made and the menu's
choice on 8 local ranks, each action at the plan's time, each stage's gradient reduction over the
replicas emulated at the plan's time after its last W (`zbcompile rehearse`), all times scaled as
`zbcompile rehearse` scales a plan by default (`plan_time_scale`: a mean action of 12-30 ms, so
8 ranks' host work on two cores stays a small share).

Printed per config and schedule: the plan's predicted step, the rehearsal's simulator on the same
times, the measured step, measured / plan and whether it is within 5%; then every pair of
schedules the plan puts more than 3% apart, and whether the measurement orders them the same way.
The load average before and after each rehearsal is printed beside it.

    python benchmarks/rehearse_plans.py                     # plan (about 5 min) and rehearse (about 12 min)
    python benchmarks/rehearse_plans.py --only moe-small    # one config
    python benchmarks/rehearse_plans.py --repeat 2          # every config twice, each run reported
    python benchmarks/rehearse_plans.py --append            # these runs added to the results kept

Writes benchmarks/results/rehearse_plans.{json,md} (with --only, the names say which)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

import _launch
from zbcompile.rehearsal.rehearse import plan_time_scale, plan_times, rehearse
from zbcompile.rehearsal.report import plan_text

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "rehearse_plans"
# config -> (data-parallel replicas, mode)
CONFIGS = {"llama-34b": (4, "replicate"), "qwen2-14b": (8, "shard"), "moe-small": (2, "replicate")}
WITHIN = 0.05  # measured step within this fraction of the plan's
APART = 0.03  # pairs the plan puts further apart than this must be ordered the same way


def plan_record(name: str, plans: pathlib.Path, replan: bool) -> dict:
    """The plan record of config `name` at pp=8, m=32 (made here unless `plans` has it)."""
    dp, mode = CONFIGS[name]
    path = plans / f"{name}.plan.json"
    if replan or not path.exists():
        plans.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "zbcompile.cli", "plan", str(FIXTURES / f"{name}.json"), "--seq-len", "4096",
            "--stages", "8", "--microbatches", "32", "--dp", str(dp), "--data-parallel", mode, "--json", str(path),
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def checks(record: dict) -> tuple[list[dict], list[dict]]:
    """Per plan schedule: plan, simulator, measured and their ratio; per pair the plan puts more
    than `APART` apart: whether the measurement orders them alike."""
    rows = [
        {"name": r["name"], "plan_s": r["plan_s"], "simulator_s": r["predicted_s"], "measured_s": r["measured_s"],
         "ratio": r["measured_s"] / r["plan_s"], "within": abs(r["measured_s"] / r["plan_s"] - 1) <= WITHIN}
        for r in record["rows"] if r.get("plan_s")
    ]
    pairs = []
    for a, b in itertools.combinations(rows, 2):
        if abs(a["plan_s"] / b["plan_s"] - 1) > APART:
            faster, slower = (a, b) if a["plan_s"] < b["plan_s"] else (b, a)
            pairs.append({"faster": faster["name"], "slower": slower["name"],
                          "plan": slower["plan_s"] / faster["plan_s"],
                          "measured": slower["measured_s"] / faster["measured_s"],
                          "same": faster["measured_s"] < slower["measured_s"]})
    return rows, pairs


def text_of(rows: list[dict], pairs: list[dict]) -> str:
    table = _launch.table(
        ["schedule", "plan s", "simulator s", "measured s", "measured / plan", f"within {WITHIN:.0%}"],
        [[r["name"], f"{r['plan_s']:.3f}", f"{r['simulator_s']:.3f}", f"{r['measured_s']:.3f}", f"{r['ratio']:.3f}",
          "yes" if r["within"] else "NO"] for r in rows],
    )
    ordered = _launch.table(
        ["faster (plan)", "slower (plan)", "plan ratio", "measured ratio", "same order"],
        [[p["faster"], p["slower"], f"{p['plan']:.3f}", f"{p['measured']:.3f}", "yes" if p["same"] else "NO"]
         for p in pairs],
    )
    return f"{table}\n\nPairs the plan puts more than {APART:.0%} apart:\n\n{ordered}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append", help="these configs only")
    parser.add_argument("--plans", default=os.path.join("/tmp", "rehearse_plans"), help="plan records, kept here")
    parser.add_argument("--replan", action="store_true", help="plan again even where a record is kept")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="rehearse every config this many times")
    parser.add_argument("--append", action="store_true", help="add this invocation's runs to the results kept")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    results = "_".join(["rehearse_plans", *(args.only or ())])
    kept = _launch.RESULTS / f"{results}.json"
    runs = json.loads(kept.read_text())["runs"] if args.append and kept.exists() else []
    first = 1 + max((r["run"] for r in runs), default=0)
    records = {name: plan_record(name, pathlib.Path(args.plans), args.replan) for name in names}
    for run, name in itertools.product(range(first, first + args.repeat), names):
        scale = plan_time_scale(records[name])
        before = _launch.machine()
        started = time.perf_counter()
        record = rehearse(plan_times(records[name], scale, steps=args.steps, rounds=args.rounds, timeout_s=1800))
        after = _launch.machine()
        rows, pairs = checks(record)
        load = _launch.before_after({"machine_before": before, "machine_after": after})
        text = (f"{name}, run {run}: {record['label']}; {time.perf_counter() - started:.0f} s; {load}\n\n"
                f"{text_of(rows, pairs)}\n\n{plan_text(record).strip()}")
        print(text + "\n", flush=True)
        runs.append({"config": name, "run": run, "label": record["label"], "time_scale": scale, "rows": rows,
                     "pairs": pairs, "machine": [before, after], "text": text})
    misses = [f"{r['config']} run {r['run']}: {row['name']} {row['ratio']:.3f}"
              for r in runs for row in r["rows"] if not row["within"]]
    swaps = [f"{r['config']} run {r['run']}: {p['faster']} / {p['slower']}"
             for r in runs for p in r["pairs"] if not p["same"]]
    summary = (f"Outside {WITHIN:.0%} of the plan: {', '.join(misses) or 'none'}.\n"
               f"Ordered unlike the plan: {', '.join(swaps) or 'none'}.")
    print(summary)
    if not args.no_write:
        sections = "\n".join(f"## {r['text']}\n" for r in runs)
        markdown = "# Plans rehearsed (`benchmarks/rehearse_plans.py`)\n\n" + summary + "\n\n" + sections
        paths = _launch.write_results(results, {"runs": runs, "summary": summary}, markdown)
        print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
