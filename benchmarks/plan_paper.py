"""The paper's four GPT models planned with the paper's own per-pass times (Table 9, A100 80GB) as
the hardware profile, against its measured throughput ratios (Table 4).

Each model (`zbcompile.models.GPT`: sequence 1024, GPT-2's vocabulary, tied embeddings, dropout
0.1 as Megatron-LM's) is
planned on the meta device at the paper's p and smallest m; the A100-80GB profile is calibrated
with `Hardware.from_measured` so that the stages' predicted F, I and W times fit T_F, T_B, T_W and
the boundary message takes T_comm. Then 1F1B, ZB-1p (zb-auto under p microbatches' activations
of the largest stage, 1F1B's peak) and ZB-2p (2p) are solved and simulated; the ratio of steady
step times (spans: the paper's steps run back to back under post-validation) is the predicted
throughput ratio. Prints a table; writes benchmarks/results/plan_paper.{json,md}.

    PYTHONPATH=. python benchmarks/plan_paper.py [--only 1.5B]
"""

from __future__ import annotations

import argparse
import time

import torch

import _launch
import zbcompile
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.planner.hardware import Hardware
from zbcompile.schedules import Costs, make_schedule, simulate

# name: (layers, hidden, heads, p, microbatch size, smallest m, (T_F, T_B, T_W, T_comm) ms, Table 4 (ZB-2p,
# ZB-1p, 1F1B))
PAPER = {
    "1.5B": (22, 2304, 24, 8, 6, 24, (18.522, 18.086, 9.337, 0.601), (14.5, 12.9, 11.8)),
    "6.2B": (30, 4096, 32, 8, 3, 24, (29.718, 29.444, 19.927, 0.527), (4.32, 3.88, 3.50)),
    "14.6B": (46, 5120, 40, 16, 1, 48, (11.347, 11.248, 8.132, 0.377), (1.81, 1.61, 1.40)),
    "28.3B": (62, 6144, 48, 32, 1, 96, (10.419, 10.207, 7.715, 0.408), (0.99, 0.87, 0.76)),
}
SEQ, VOCAB = 1024, 50257
# Megatron-LM's GPT drops out attention probabilities and hidden states at 0.1, which the paper's
# activation memory counts (M_B = sb(34h + 5as): the attention scores, their softmax and dropout
# mask; M_W = 32sbh), so its M_W is about a third of M_B; without dropout (flash attention) M_W is
# about M_B and a ZB-1p limit of p M_B leaves W no room to be deferred
DROPOUT = 0.1


def plan_model(name: str) -> dict:
    layers, hidden, heads, p, size, m, (t_f, t_b, t_w, t_comm), (zb2, zb1, base) = PAPER[name]
    with torch.device("meta"):
        config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=hidden, heads=heads, layers=layers, dropout=DROPOUT)
        model = GPT(config)
        tokens = torch.zeros(size * m, SEQ, dtype=torch.long)
    started, cpu = time.perf_counter(), time.process_time()
    first = zbcompile.plan(
        model, tokens, target=tokens, loss_fn=lm_loss, stages=p, microbatches=m, hardware="A100-80GB",
        schedules=("1f1b",),
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    measured = Costs(f=t_f / 1e3, i=t_b / 1e3, w=t_w / 1e3, comm=t_comm / 1e3)
    hardware = Hardware.from_measured(measured, first.static_costs(), like="A100-80GB",
                                      boundary_bytes=first.costed.partition.boundary_bytes)
    planned = first.on(hardware)
    costs = planned.costs
    spans = solve(costs, p, m)
    predicted = {k: spans["1F1B"] / spans[k] for k in ("ZB-1p", "ZB-2p")}
    paper = {"ZB-1p": zb1 / base, "ZB-2p": zb2 / base}
    return {
        "model": name, "p": p, "m": m, "microbatch": size, "plan_seconds": seconds, "plan_cpu_seconds": cpu,
        "efficiency": dict(hardware.pass_efficiency), "link_bandwidth": hardware.link_bandwidth,
        "predicted_ms": {k: [x * 1e3 for x in getattr(costs, k)] for k in ("f", "i", "w")},
        "comm_ms": costs.comm * 1e3, "spans_ms": {k: v * 1e3 for k, v in spans.items()},
        "predicted_ratio": predicted, "paper_ratio": paper,
        "error": {k: predicted[k] / paper[k] - 1 for k in predicted},
    }


def solve(costs: Costs, p: int, m: int) -> dict[str, float]:
    """Steady step (span) of 1F1B, ZB-1p (zb-auto under p units of the largest M_B) and ZB-2p (2p)."""
    spans = {}
    for label, schedule, limit in (("1F1B", "1f1b", None), ("ZB-1p", "zb-auto", p), ("ZB-2p", "zb-auto", 2 * p)):
        made = make_schedule(schedule, p, m, costs, limit, time_budget=5.0, placements=("in-line",))
        spans[label] = simulate(made, costs).span
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=PAPER, default=None)
    args = parser.parse_args()
    results = [plan_model(name) for name in ([args.only] if args.only else PAPER)]
    lines = [
        "| model | p | m | plan (s, CPU s) | ZB-1p/1F1B predicted | paper | error | ZB-2p/1F1B predicted | paper | "
        "error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['p']} | {r['m']} | {r['plan_seconds']:.0f}, {r['plan_cpu_seconds']:.0f} | "
            + " | ".join(
                f"{r['predicted_ratio'][k]:.3f} | {r['paper_ratio'][k]:.3f} | {r['error'][k]:+.1%}"
                for k in ("ZB-1p", "ZB-2p")
            )
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    if args.only is None:
        _launch.write_results("plan_paper", results, table, indent=1)


if __name__ == "__main__":
    main()
