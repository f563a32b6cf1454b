"""The plan's cut where memory binds or the ranks differ (`zbcompile/planner/cut.py`): each config
planned with the compiler's cut (balanced by FLOPs) and with the cut the plan chooses by
predicted step time under each rank's memory, zb-auto's peak per rank and steady step for both.

    python benchmarks/plan_memory_cut.py            # ~3 minutes of CPU (compiles on the meta device)
    python benchmarks/plan_memory_cut.py --quick    # the Mixtral config only

Writes benchmarks/results/plan_memory_cut.{json,md}. Predictions, not timings: the numbers do not
depend on the machine's load.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import _launch

CONFIGS = pathlib.Path(__file__).parent / "configs"
CASES = [
    # (label, config, stages, dp, hardware per rank or for all)
    ("Mixtral-8x7B (MoE: experts hold 4x the parameters per FLOP)", "mixtral-8x7b.json", 8, 4, "H100-80GB"),
    ("Llama-3-70B (dense)", "llama3-70b.json", 16, 8, "H100-80GB"),
    ("Llama-3-70B, the last rank an A100 among H100s", "llama3-70b.json", 16, 8, ["H100-80GB"] * 15 + ["A100-80GB"]),
]


def plan_case(config: str, stages: int, dp: int, hardware) -> dict:
    import torch

    from zbcompile.compiler import compile_costs
    from zbcompile.planner import cli as planner_cli
    from zbcompile.planner.plan import PlanOptions, plan, plan_compiled
    from zbcompile.runtime.parallel.batch import split

    args = argparse.Namespace(model=str(CONFIGS / config), batch=None, microbatches=32, seq_len=4096, dtype="bfloat16")
    model, inputs, kwargs, target, loss_fn = planner_cli.build(args)
    started = time.perf_counter()
    chosen = plan(model, *inputs, stages=stages, microbatches=32, dp=dp, hardware=hardware, **kwargs)
    seconds = time.perf_counter() - started
    (micro_args, micro_kwargs), micro_target = [x[0] for x in split(inputs, kwargs, target, 32)[:2]]
    flop_cut = plan_compiled(
        compile_costs(model, loss_fn, micro_args, micro_kwargs, micro_target, stages, device=torch.device("cpu")),
        hardware, PlanOptions(32, dp),
    )

    def zb_auto(p) -> dict:
        entry = next(e for e in p.record["schedules"] if e["name"] == "zb-auto")
        return {
            "fits": bool(entry.get("fits")), "span_s": entry.get("span"), "error": entry.get("error"),
            "peak_gb": [round(b / 1e9, 2) for b in entry.get("peak_bytes", [])],
            "state_gb": [round(s / 1e9, 2) for s in p.state], "cuts": list(p.costed.partition.cuts),
            "choice": p.record["zb_auto"],
        }

    return {"flop_cut": zb_auto(flop_cut), "chosen": zb_auto(chosen), "cut": chosen.record.get("cut"),
            "plan_seconds": seconds}


def report(results: list[dict]) -> str:
    lines = [
        "# The plan's cut where memory binds or the ranks differ",
        "",
        "zb-auto's plan (m=32, 4096 tokens per sequence, AdamW state in bf16, data_parallel='replicate') with the "
        "compiler's cut (balanced by FLOPs) and with the cut chosen by predicted step time under each rank's memory "
        "(`zbcompile plan`'s default where memory binds or the ranks differ).",
        "",
    ]
    rows = []
    for r in results:
        for name in ("flop_cut", "chosen"):
            z = r[name]
            rows.append([
                r["label"], "compiler's (FLOPs)" if name == "flop_cut" else "chosen", "yes" if z["fits"] else "no",
                f"{z['span_s']:.3f}" if z["span_s"] else "-", max(z["peak_gb"], default="-"),
                " ".join(map(str, z["state_gb"])),
            ])
    header = ["config", "cut", "zb-auto fits", "steady step s", "peak GB", "state GB per rank"]
    lines.append(_launch.table(header, rows))
    lines.append("")
    for r in results:
        cut = r["cut"] or {}
        lines.append(f"- {r['label']}: {cut.get('why', 'no decision')}; {cut.get('reason', '')} "
                     f"(plan took {r['plan_seconds']:.0f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the Mixtral config only")
    parser.add_argument("--no-write", action="store_true")
    options = parser.parse_args()
    results = []
    for label, config, stages, dp, hardware in CASES[:1] if options.quick else CASES:
        print(f"planning {label} ...", flush=True)
        results.append({"label": label, "config": config, "stages": stages, "dp": dp, "hardware": hardware,
                        **plan_case(config, stages, dp, hardware)})
    text = report(results)
    print(text)
    if not options.no_write and not options.quick:
        _launch.write_results("plan_memory_cut", {"machine": _launch.machine(), "results": results}, text)


if __name__ == "__main__":
    main()
