"""The paper's Table 5 for the Table 9 profiles, under both bubble definitions, paper beside ours.

Columns: 1F1B, ZB-H1, ZB-H2 (handcrafted), ZB-1p and ZB-2p (zb-auto at 1x / 2x 1F1B's memory,
M_W = M_B/2), ZB-V (handcrafted, two chunks per rank, each half a stage, at 1F1B's memory). "stage"
is the paper's definition (1 - busy / (p * span)); "makespan" uses the step with a barrier. Further
blocks: zb-auto with objective="makespan" at 2p and 1p against the proven lower bound, zb-auto's
span value, bound, status and solve time, and the heuristic's time alone.

    .venv/bin/python benchmarks/bubble_table.py [--time-budget 3] [--rows 1.5B]
Writes benchmarks/results/bubble_table.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from zbcompile.rehearsal.rehearse import PAPER_TIMES
from zbcompile.schedules import Costs, make_schedule, simulate

# Table 5 (the paper's stage bubble rates), from reference/paper.md; Table 9's profiles are PAPER_TIMES
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

EXPLAIN = {
    "1F1B": "handcrafted; Table 9 averages the paper's per-stage profiles, which Table 5 used, so "
            "our uniform-cost value differs (the bubble (p-1)(F+I+W) + 2(p-1)comm is exact here)",
    "ZB-H1": "handcrafted; same cause as 1F1B (uniform Table 9 costs against per-stage profiles)",
    "ZB-H2": "handcrafted; same cause as 1F1B (uniform Table 9 costs against per-stage profiles)",
    "ZB-1p": "zb-auto at 1F1B's memory",
    "ZB-2p": "zb-auto at twice 1F1B's memory",
}


def run_row(model: str, m: int, budget: float) -> dict:
    p, f, b, w, comm, _ = PAPER_TIMES[model]
    costs = Costs(f=f, i=b, w=w, comm=comm, mem_b=1.0, mem_w=0.5)
    chunk_costs = Costs(f=f / 2, i=b / 2, w=w / 2, comm=comm, mem_b=0.5, mem_w=0.25)
    solver = {"time_budget": budget, "placements": ("in-line",)}
    built = {
        "1F1B": (make_schedule("1f1b", p, m, costs, check=False), costs),
        "ZB-H1": (make_schedule("zb-h1", p, m, costs, check=False), costs),
        "ZB-H2": (make_schedule("zb-h2", p, m, costs, check=False), costs),
        "ZB-1p": (make_schedule("zb-auto", p, m, costs, memory_limit=float(p), **solver), costs),
        "ZB-2p": (make_schedule("zb-auto", p, m, costs, memory_limit=2.0 * p, **solver), costs),
        "ZB-V": (make_schedule("zbv", 2 * p, m, chunk_costs, check=False), chunk_costs),
    }
    row = {"model": model, "p": p, "m": m, "ours": {}, "paper": dict(zip(COLUMNS, PAPER[(model, m)]))}
    for name, (sched, c) in built.items():
        res = simulate(sched, c)
        info = sched.info
        row["ours"][name] = {
            "stage_bubble_rate": res.stage_bubble_rate, "bubble_rate": res.bubble_rate, "span": res.span,
            "makespan": res.makespan, "peak_memory": max(res.peak_memory),
            **{key: info.get(key) for key in ("lower_bound", "status", "solve_time_s", "heuristic_time_s")},
            "source": info.get("zbv_source") or info.get("heuristic_source"),
        }
    for factor in (2, 1):
        started = time.perf_counter()
        mk = make_schedule("zb-auto", p, m, costs, memory_limit=factor * p, objective="makespan", **solver)
        res = simulate(mk, costs)
        bound = mk.info["lower_bound"]
        row[f"makespan_{factor}p"] = {
            "makespan": res.makespan,
            "lower_bound": bound,
            "gap": res.makespan / bound - 1,
            "status": mk.info.get("status"),
            "time_s": time.perf_counter() - started,
        }
    return row


def to_markdown(rows: list[dict], heuristic_time: float) -> str:
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
                cells.append(
                    f"{ours:.4f}" + (f" ({paper:.4f})" if paper is not None and metric == "stage_bubble_rate" else "")
                )
            out.append(f"| {r['model']} | {r['p']} | {r['m']} | " + " | ".join(cells) + " |")
        out.append("")
    for factor in (2, 1):
        out += [f"## zb-auto, objective=makespan, memory {factor}p, against the proven lower bound", "",
                "| model | m | makespan | lower bound | gap | status |", "|---|---|---|---|---|---|"]
        for r in rows:
            mk = r[f"makespan_{factor}p"]
            out.append(f"| {r['model']} | {r['m']} | {mk['makespan']:.3f} | {mk['lower_bound']:.3f} | "
                       f"{100 * mk['gap']:.3f}% | {mk['status']} |")
        out.append("")
    out += [
        "## zb-auto span: value, proven lower bound, status, solve time (budget included: heuristic, search, CP-SAT)",
        "",
        "| model | m | ZB-1p span | bound | status | time s | ZB-2p span | bound | status | time s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["ours"]["ZB-1p"], r["ours"]["ZB-2p"]
        out.append(
            f"| {r['model']} | {r['m']} | {a['span']:.3f} | {a['lower_bound']:.3f} | {a['status']} | "
            f"{a['solve_time_s']:.2f} | "
            f"{b['span']:.3f} | {b['lower_bound']:.3f} | {b['status']} | {b['solve_time_s']:.2f} |"
        )
    out += ["", f"Heuristic alone (zb-auto's first step), p=32, m=256, memory 2p: {heuristic_time:.2f} s "
            "(best of 3 runs).", ""]
    out += ["## zb-auto against the paper (stage bubble rate, 4 decimals)", ""]
    worse = [(r["model"], r["m"], c) for r in rows for c in ("ZB-1p", "ZB-2p")
             if round(r["ours"][c]["stage_bubble_rate"], 4) > r["paper"][c]]
    out.append("At most the paper's value in every row and column." if not worse else
               "Above the paper's value: " + ", ".join(f"{m} m={n} {c}" for m, n, c in worse) + ".")
    out += ["", "## Differences from the paper larger than 0.005 (stage bubble rate)", ""]
    diffs = []
    for r in rows:
        for c in COLUMNS:
            paper = r["paper"].get(c)
            if paper is None:
                continue
            ours = r["ours"][c]["stage_bubble_rate"]
            if abs(ours - paper) > 0.005:
                sign = "lower" if ours < paper else "higher"
                why = EXPLAIN[c]
                if c.startswith("ZB-") and c[3] in "12":
                    why += (": lower because the search found a better order for these uniform costs"
                            if ours < paper else ": the search did not reach the paper's order within the budget")
                diffs.append(f"- {r['model']} m={r['m']} {c}: ours {ours:.4f}, paper {paper:.4f} ({sign}); {why}.")
    out += diffs or ["None."]
    out += ["", NOTES]
    return "\n".join(out) + "\n"


NOTES = """## Notes

- Costs are Table 9's, the same on every stage, M_W = M_B/2, memory in units of M_B per stage
  (1p = p M_B, 1F1B's peak). ZB-V uses two chunks per rank with half of each cost and
  mem_b = M_B/2 per chunk, so its 1F1B-equal memory is p M_B per rank; it is not in the paper's
  Table 5 (the follow-up paper, arXiv 2405.15362, reports it) and has no paper column here.
- ZB-1p: at p M_B the heuristic keeps ZB-H1 or the search's equal member of its family; the
  paper's ZB-1p column equals its ZB-H1 column too. Where ours is lower than the paper's, the cause is
  the uniform profile (see 1F1B).
- 28.3B m=96, ZB-2p (ours 0.00376, paper 0.0038): the paper's own heuristic construction
  (`reference.py`: each stage warms up with as many F as fit before the first gradient returns,
  W inserted where a stage would otherwise wait or memory demands it, three flags grid-searched)
  is one of zb-auto's heuristic candidates and wins here; the list scheduler and the search family
  left a 3-5 ms gap at the end of the steady state on stages whose forwards ran out before their
  downstream neighbour's (0.0049 before). The search evaluates only ~70 orders of this size
  (9216 actions) in 3 s and CP-SAT is not used at this size, so it does not improve further.
  The construction is kept only where it is strictly better under the objective: at 1p it ties
  ZB-H1's span but starts stages later (a larger makespan).
- CP-SAT runs for p m <= 400 (3 p m <= 1200 actions), warm-started from the search; for 1.5B m=24
  at 2p it proves span >= 1152.52 against our 1152.60 (paper 0.0433 = ours to 4 decimals).
- Bubble rates with a barrier are higher than the stage rates because every stage waits for the
  pipeline to fill and drain; the paper's post-validated optimizer step removes the barrier.
"""


def time_heuristic() -> float:
    from zbcompile.schedules.costs import resolve_costs
    from zbcompile.schedules.heuristic import zb_auto_heuristic

    p, f, b, w, comm, _ = PAPER_TIMES["28.3B"]
    sc = resolve_costs(Costs(f=f, i=b, w=w, comm=comm), p)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        zb_auto_heuristic(p, 256, sc, [2.0 * p] * p, "span")
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-budget", type=float, default=3.0, help="zb-auto solver seconds per schedule")
    parser.add_argument("--rows", default=None, help="comma-separated models to run (default: all)")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    models = args.rows.split(",") if args.rows else list(PAPER_TIMES)
    rows = []
    for model in models:
        for m in PAPER_TIMES[model][-1]:
            row = run_row(model, m, args.time_budget)
            rows.append(row)
            ours = row["ours"]
            print(
                f"{model:>6} m={m:<4}"
                + "".join(
                    f" {c}={ours[c]['stage_bubble_rate']:.4f}({row['paper'].get(c, float('nan')):.4f})" for c in COLUMNS
                )
                + f" | makespan gap 2p {100 * row['makespan_2p']['gap']:.3f}% 1p "
                  f"{100 * row['makespan_1p']['gap']:.3f}%",
                flush=True,
            )
    heuristic_time = time_heuristic()
    md = to_markdown(rows, heuristic_time)
    print(md)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bubble_table.json"), "w") as fh:
        json.dump(
            {"time_budget_s": args.time_budget, "heuristic_time_s_p32_m256": heuristic_time, "rows": rows}, fh, indent=1
        )
    with open(os.path.join(args.out_dir, "bubble_table.md"), "w") as fh:
        fh.write(md)


if __name__ == "__main__":
    main()
