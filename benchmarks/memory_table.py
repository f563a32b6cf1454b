"""Peak activation memory against bubble rate: the comparison of "Pipeline Parallelism with
Controllable Memory" (Qi, Wan, Amar, Lin, 2024), reproduced with the simulator.

Schedules: 1F1B, ZB-1p (zb-h1), ZB-2p (zb-h2), ZB-V (zbv), and the building-block V schedules
V-ZB, V-Half, V-Min (``zbcompile/schedules/building_block.py``). The model is cut into p stages
with T_F = T_B = T_W = 1 per stage, M_W = M_B / 2, no communication delay (the paper's setting);
the V schedules run the same model in 2p chunks of half a stage (costs ``chunked(2)``) on the same
p ranks. For each schedule: peak memory over 1F1B's (the largest rank) and the stage bubble rate
(the paper's: 1 - busy / (p * span)) as a multiple of B = (p-1)/(m+p-1), 1F1B's bubble rate.

The paper's figures (the authors' repository README, T_F = T_B = T_W):

| | 1F1B | ZB-1p | ZB-2p | ZB-V | V-Half | V-Min |
|---|---|---|---|---|---|---|
| bubble rate | B | B/3 | 0 | 0 | B/2 | 2B/3 + O(n) |
| activation memory (x 1F1B) | 1 | 1 | 2 | 1 | 1/2 | 1/3 |

What the results show (``benchmarks/results/memory_table.md``, p = 4, 8, 16, m = 2p and 4p): the
bubble multiples match the paper's: ZB-1p 0.37-0.42 B, ZB-2p and ZB-V 0, V-Half 0.31-0.55 B,
V-Min 0.65-0.74 B. V-ZB keeps 0.07-0.11 B (the paper: 0): squeezing the repeated block leaves a
small warm-up and cool-down bubble that the handcrafted ZB-V order (``zbv``) does not have. The
fractions of V-Half and V-Min approach 1/2 and 1/3 as p grows and sit above them at small p: a
rank's peak counts whole chunk activations, and each building block rounds its lifespan up to
whole intervals (the paper's bound ceil(lifespan / interval), which the paper's fractions leave
out); with M_W = M_B / 2 the weight-gradient stash adds up to half a chunk per pending W.

    .venv/bin/python benchmarks/memory_table.py [--ranks 4,8,16] [--per-rank 2,4]
Writes benchmarks/results/memory_table.{json,md}.
"""

from __future__ import annotations

import argparse
import time

from _launch import write_results
from zbcompile.schedules import Costs, make_schedule, schedule_spec, simulate

COLUMNS = {  # label -> schedule name
    "1F1B": "1f1b",
    "ZB-1p": "zb-h1",
    "ZB-2p": "zb-h2",
    "ZB-V": "zbv",
    "V-ZB": "v-zb",
    "V-Half": "v-half",
    "V-Min": "v-min",
}
PAPER = {  # label -> (bubble as a multiple of B, memory as a fraction of 1F1B's)
    "1F1B": (1.0, 1.0),
    "ZB-1p": (1 / 3, 1.0),
    "ZB-2p": (0.0, 2.0),
    "ZB-V": (0.0, 1.0),
    "V-ZB": (0.0, 1.0),
    "V-Half": (0.5, 0.5),
    "V-Min": (2 / 3, 1 / 3),
}
STAGE = Costs(f=1.0, i=1.0, w=1.0, comm=0.0, mem_b=1.0, mem_w=0.5)


def run_row(p: int, m: int) -> dict:
    per_stage = STAGE.resolve(p)
    one_b = (p - 1) / (m + p - 1)
    results = {}
    for label, name in COLUMNS.items():
        chunks = schedule_spec(name).chunks_per_rank
        costs = per_stage.chunked(chunks) if chunks > 1 else per_stage
        started = time.perf_counter()
        sched = make_schedule(name, p * chunks, m, costs)
        build_s = time.perf_counter() - started
        res = simulate(sched, costs)
        results[label] = {"peak": max(res.peak_memory), "stage_bubble_rate": res.stage_bubble_rate,
                          "bubble_rate": res.bubble_rate, "build_s": build_s}
    base = results["1F1B"]["peak"]
    for r in results.values():
        r["memory_vs_1f1b"] = r["peak"] / base
        r["bubble_vs_B"] = r["stage_bubble_rate"] / one_b
    return {"p": p, "m": m, "B": one_b, "ours": results}


def to_markdown(rows: list[dict]) -> str:
    labels = list(COLUMNS)
    lines = [
        "# Peak memory and bubble rate (simulator, T_F = T_B = T_W, M_W = M_B/2, no comm delay)",
        "",
        "Each cell: stage bubble rate as a multiple of B = (p-1)/(m+p-1) / peak memory over 1F1B's.",
        "",
        "| p | m | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for row in rows:
        cells = [f"{row['ours'][c]['bubble_vs_B']:.2f}B / {row['ours'][c]['memory_vs_1f1b']:.2f}" for c in labels]
        lines.append(f"| {row['p']} | {row['m']} | " + " | ".join(cells) + " |")
    lines.append("| paper | | " + " | ".join(f"{PAPER[c][0]:.2f}B / {PAPER[c][1]:.2f}" for c in labels) + " |")
    lines += [
        "",
        "Stage bubble rates:",
        "",
        "| p | m | B | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for row in rows:
        lines.append(
            f"| {row['p']} | {row['m']} | {row['B']:.4f} | "
            + " | ".join(f"{row['ours'][c]['stage_bubble_rate']:.4f}" for c in labels)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,8,16", help="comma-separated pipeline ranks p")
    parser.add_argument("--per-rank", default="2,4", help="comma-separated m / p (microbatches per rank)")
    args = parser.parse_args()
    rows = []
    for p in (int(v) for v in args.ranks.split(",")):
        for k in (int(v) for v in args.per_rank.split(",")):
            row = run_row(p, k * p)
            rows.append(row)
            print(
                f"p={p:<3} m={k * p:<4}"
                + "".join(
                    f" {c}={row['ours'][c]['bubble_vs_B']:.2f}B/{row['ours'][c]['memory_vs_1f1b']:.2f}" for c in COLUMNS
                ),
                flush=True,
            )
    md = to_markdown(rows)
    print(md)
    write_results("memory_table", {"costs": vars(STAGE), "paper": PAPER, "rows": rows}, md)


if __name__ == "__main__":
    main()
