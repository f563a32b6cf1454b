"""The paper's Table 5 for the Table 9 profiles, under both bubble definitions, paper beside ours.

Columns: 1F1B, ZB-H1, ZB-H2 (handcrafted), ZB-1p and ZB-2p (zb-auto at 1x / 2x 1F1B's memory,
M_W = M_B/2), ZB-V (two chunks per rank, each half a stage, at 1F1B's memory). "stage" is the
paper's definition (1 - busy / (p * span)); "makespan" uses the step with a barrier. A last block
runs zb-auto with objective="makespan" at 2p against the no-memory lower bound.

    .venv/bin/python benchmarks/bubble_table.py [--time-budget 3] [--rows 1.5B]
Writes benchmarks/results/bubble_table.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from zbcompile.schedules import Costs, make_schedule, simulate

# Table 9 (profiles) and Table 5 (the paper's stage bubble rates), from reference/paper.md.
PROFILES = {
    "1.5B": (8, (24, 32, 64), 18.522, 18.086, 9.337, 0.601),
    "6.2B": (8, (24, 32, 64), 29.718, 29.444, 19.927, 0.527),
    "14.6B": (16, (48, 64, 128), 11.347, 11.248, 8.132, 0.377),
    "28.3B": (32, (96, 128, 256), 10.419, 10.207, 7.715, 0.408),
}
PAPER = {  # model, m -> 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p
    ("1.5B", 24): (0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 32): (0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 64): (0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 24): (0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 32): (0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 64): (0.1091, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 48): (0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 64): (0.2082, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 128): (0.1251, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 96): (0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 128): (0.2168, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 256): (0.1352, 0.0594, 0.0257, 0.0594, 0.0018),
}
COLUMNS = ("1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p", "ZB-V")

NOTES = """## Differences from the paper larger than 0.005 (stage bubble rate), and why

- 1F1B, ZB-H1, ZB-H2 agree with the paper to 4 decimals in 8 of 12 rows, so the time and memory
  model is the paper's. 1.5B m=64, 1F1B: ours 0.1187, paper 0.1240. With uniform costs the 1F1B
  bubble is (p-1)(F+B+W) + 2(p-1)comm, which gives 0.1187 for this row; the paper computed Table 5
  from its own per-stage profiles (first and last stage differ), which Table 9 averages away. The
  other rows with m = 32/64/256 differ by less than 0.005 for the same reason.
- ZB-2p, 1.5B m=24 (ours 0.0516, paper 0.0433) and m=32 (ours 0.0275, paper 0.0039): our
  heuristic plus 3 s of CP-SAT does not find the paper's schedule. For m=24 CP-SAT proves
  span >= 1152.5 (rate >= 0.0432), so the paper's value is essentially optimal and the remaining
  gap is search, not model. The 28.3B rows are worse by 0.0007-0.0029 (below 0.005) for the same
  reason: at p=32 building the CP-SAT model takes most of the budget and the heuristic stands.
- ZB-1p equals ZB-H1 in every row (the heuristic keeps ZB-H1 when nothing better is found within
  the budget), i.e. the paper's ZB-1p column, which also equals its ZB-H1 column.
- ZB-V is not in the paper's Table 5. Ours is list-scheduled at 1F1B's memory with two chunks per
  rank (each half a stage) and double the hops; with these profiles it is worse than ZB-H1 (with
  T_F = T_B = T_W it reaches zero bubble, as the follow-up paper's ZB-V does).
"""


def run_row(model: str, m: int, budget: float) -> dict:
    p, _, f, b, w, comm = PROFILES[model]
    costs = Costs(f=f, b=b, w=w, comm=comm, mem_f=1.0, mem_w=0.5)
    chunk_costs = Costs(f=f / 2, b=b / 2, w=w / 2, comm=comm, mem_f=0.5, mem_w=0.25)
    built = {
        "1F1B": (make_schedule("1f1b", p, m, costs, check=False), costs),
        "ZB-H1": (make_schedule("zb-h1", p, m, costs, check=False), costs),
        "ZB-H2": (make_schedule("zb-h2", p, m, costs, check=False), costs),
        "ZB-1p": (make_schedule("zb-auto", p, m, costs, memory_limit=float(p), time_budget=budget), costs),
        "ZB-2p": (make_schedule("zb-auto", p, m, costs, memory_limit=2.0 * p, time_budget=budget), costs),
        "ZB-V": (make_schedule("zbv", 2 * p, m, chunk_costs, check=False), chunk_costs),
    }
    row = {"model": model, "p": p, "m": m, "ours": {}, "paper": dict(zip(COLUMNS, PAPER[(model, m)]))}
    for name, (sched, c) in built.items():
        res = simulate(sched, c)
        row["ours"][name] = {
            "stage_bubble_rate": res.stage_bubble_rate,
            "bubble_rate": res.bubble_rate,
            "span": res.span,
            "makespan": res.makespan,
            "peak_memory": max(res.peak_memory),
            "lower_bound": sched.info.get("lower_bound"),
            "status": sched.info.get("status"),
            "solve_time_s": sched.info.get("solve_time_s"),
        }
    started = time.perf_counter()
    mk = make_schedule("zb-auto", p, m, costs, memory_limit=2.0 * p, objective="makespan", time_budget=budget)
    res = simulate(mk, costs)
    bound = mk.info["lower_bound"]
    row["makespan_2p"] = {
        "makespan": res.makespan,
        "lower_bound": bound,
        "gap": res.makespan / bound - 1,
        "time_s": time.perf_counter() - started,
    }
    return row


def to_markdown(rows: list[dict]) -> str:
    out = ["# Bubble rates for the paper's Table 9 profiles (uniform across stages, M_W = M_B/2)", ""]
    for metric, title in (("stage_bubble_rate", "Stage bubble rate (the paper's: 1 - busy/(p*span))"),
                          ("bubble_rate", "Bubble rate with a barrier per step (1 - busy/(p*makespan))")):
        out += [f"## {title}", "", "ours (paper) — ZB-V is not in the paper's Table 5", ""]
        out.append("| model | p | m | " + " | ".join(COLUMNS) + " |")
        out.append("|---|---|---|" + "---|" * len(COLUMNS))
        for r in rows:
            cells = []
            for c in COLUMNS:
                ours = r["ours"][c][metric]
                paper = r["paper"].get(c)
                cells.append(f"{ours:.4f}" + (f" ({paper:.4f})" if paper is not None and metric == "stage_bubble_rate" else ""))
            out.append(f"| {r['model']} | {r['p']} | {r['m']} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## zb-auto, objective=makespan, memory 2p, against the no-memory lower bound", "",
            "| model | m | makespan | lower bound | gap |", "|---|---|---|---|---|"]
    for r in rows:
        mk = r["makespan_2p"]
        out.append(f"| {r['model']} | {r['m']} | {mk['makespan']:.3f} | {mk['lower_bound']:.3f} | {100 * mk['gap']:.3f}% |")
    out += ["", "## zb-auto span: value, proven lower bound, solver status", "",
            "| model | m | ZB-1p span | bound | status | ZB-2p span | bound | status |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["ours"]["ZB-1p"], r["ours"]["ZB-2p"]
        out.append(f"| {r['model']} | {r['m']} | {a['span']:.3f} | {a['lower_bound']:.3f} | {a['status']} | "
                   f"{b['span']:.3f} | {b['lower_bound']:.3f} | {b['status']} |")
    return "\n".join(out) + "\n\n" + NOTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-budget", type=float, default=3.0, help="zb-auto solver seconds per schedule")
    parser.add_argument("--rows", default=None, help="comma-separated models to run (default: all)")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    models = args.rows.split(",") if args.rows else list(PROFILES)
    rows = []
    for model in models:
        for m in PROFILES[model][1]:
            row = run_row(model, m, args.time_budget)
            rows.append(row)
            ours = row["ours"]
            print(f"{model:>6} m={m:<4}" + "".join(f" {c}={ours[c]['stage_bubble_rate']:.4f}({row['paper'].get(c, float('nan')):.4f})" for c in COLUMNS)
                  + f" | makespan-2p gap {100 * row['makespan_2p']['gap']:.3f}%", flush=True)
    md = to_markdown(rows)
    print(md)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bubble_table.json"), "w") as fh:
        json.dump({"time_budget_s": args.time_budget, "rows": rows}, fh, indent=1)
    with open(os.path.join(args.out_dir, "bubble_table.md"), "w") as fh:
        fh.write(md)


if __name__ == "__main__":
    main()
