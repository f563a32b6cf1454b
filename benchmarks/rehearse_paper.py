"""The paper's runs rehearsed: the real runtime at p = 8, 16 and 32 on this machine, each action
taking the paper's measured time (Table 9), beside torch.distributed.pipelining's schedules under
the same times (`zbcompile rehearse`, zbcompile/rehearsal/rehearse.py).

Per setting (the paper's smallest m): our 1F1B, ZB-H1, ZB-H2, zb-auto under 1F1B's memory and
twice it (the paper's ZB-1p and ZB-2p) and zb-auto as a pipeline makes it by default; at p = 8 and
16 torch's Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (ZB1P),
ScheduleZBVZeroBubble and ScheduleDualPipeV. Every schedule runs `--steps` steps back to back per
round, rounds in alternating order. Printed per setting: the rehearsal's table (measured step and
bubble beside the simulator's for the same times), and three checks: each of our bubbles within
0.02 of the simulator's; ZB-2p / 1F1B and ZB-1p / 1F1B throughput within 5% of Table 4's; zb-auto
at least 1.05x torch's best (paired by round).

    python benchmarks/rehearse_paper.py                  # about 20 minutes on 2 cores
    python benchmarks/rehearse_paper.py --only 1.5B      # one setting
    python benchmarks/rehearse_paper.py --only 28.3B --time-scale 4    # every time 4x Table 9's
    python benchmarks/rehearse_paper.py --only 1.5B --every-m          # at each of the paper's m

Writes benchmarks/results/rehearse_paper.{json,md} and rehearse_paper_<model>.png (measured timelines of
1F1B, ZB-1p and ZB-2p); with --only, --every-m or --time-scale the names say which
(rehearse_paper_28.3B_x4.md, ...). A time scale keeps the simulator's bubbles and gains and makes
the runtime's own time per action (posting, waking, bookkeeping: 0.1-0.3 ms, run serially with
the emulated actions here, ahead of the device on a GPU) a smaller share: where many processes
share two cores, that host work is what stops a rehearsal at Table 9's times.
"""

from __future__ import annotations

import argparse
import time

import _launch
from zbcompile.measure import paired_ratio
from zbcompile.rehearsal.rehearse import PAPER_GAINS, PAPER_TIMES, paper_times, rehearse
from zbcompile.rehearsal.report import report_text, write_timeline_png

OURS = ("1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zb-auto")
TORCH = (
    "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
# p = 32 on two cores: 32 processes' host work between actions competes for the cores (see the results)
SETTINGS = {
    "1.5B": (OURS, TORCH), "6.2B": (OURS, TORCH), "14.6B": (OURS, TORCH), "28.3B": (("1f1b", "zb-1p", "zb-2p"), ()),
}


def checks(record: dict, model: str) -> list[str]:
    """The three checks of this benchmark on one setting's record, as lines."""
    rows = {r["name"]: r for r in record["rows"]}
    lines = []
    for r in record["rows"]:
        if "bubble_predicted" in r:
            gap = r["bubble"] - r["bubble_predicted"]
            ok = "yes" if abs(gap) <= 0.02 else "NO"
            lines.append(
                f"bubble {r['name']}: measured {r['bubble']:.4f}, simulator {r['bubble_predicted']:.4f} "
                f"({gap:+.4f}; within 0.02: {ok})"
            )
    for name, paper in zip(("zb-2p", "zb-1p"), PAPER_GAINS[model]):
        if name in rows and "gain" in rows[name]:
            gain = rows[name]["gain"]
            ok = "yes" if abs(gain / paper - 1) <= 0.05 else "NO"
            lines.append(
                f"{name} / 1F1B: measured {gain:.3f}, simulator {rows[name]['gain_predicted']:.3f}, "
                f"Table 4 {paper:.3f} ({gain / paper - 1:+.1%}; within 5%: {ok})"
            )
    theirs = [r for r in record["rows"] if r["library"] == "torch"]
    if theirs and "zb-auto" in rows:
        best = min(theirs, key=lambda r: r["measured_s"])
        ratio = paired_ratio(best["rounds_s"], rows["zb-auto"]["rounds_s"])
        ok = "yes" if ratio >= 1.05 else "NO"
        lines.append(f"zb-auto vs torch's best ({best['name']}): {ratio:.3f}x (paired by round; >= 1.05: {ok})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(SETTINGS), action="append", help="these settings only")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=1.0, help="every time this many times Table 9's")
    parser.add_argument("--every-m", action="store_true", help="each setting at each of the paper's m (Table 4)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    before = _launch.machine()
    print(f"machine: {_launch.load_line(before)}", flush=True)
    started = time.perf_counter()
    results, sections = {}, []
    scaled = [f"x{args.time_scale:g}"] if args.time_scale != 1 else []
    name = "_".join(["rehearse_paper", *(args.only or ()), *(["every_m"] if args.every_m else []), *scaled])
    for model in args.only or SETTINGS:
        ours, theirs = SETTINGS[model]
        rounds = args.rounds if model != "28.3B" else 1
        for m in PAPER_TIMES[model][-1] if args.every_m else (None,):
            settings = paper_times(
                model, m, args.time_scale, schedules=ours, torch_schedules=theirs, steps=args.steps, rounds=rounds,
                timeout_s=1800,
            )
            record = rehearse(settings)
            lines = checks(record, model)
            text = report_text(record) + "\n\n" + "\n".join(f"- {line}" for line in lines)
            print(text + "\n", flush=True)
            sections.append(f"## {settings.label}\n\n```\n{text}\n```\n")
            results[settings.label] = {**{k: v for k, v in record.items() if k != "timelines"}, "checks": lines}
            if not args.no_write:
                at = [f"m{settings.microbatches}"] if args.every_m else []
                png = _launch.RESULTS / ("_".join(["rehearse_paper", model, *at, *scaled]) + ".png")
                write_timeline_png(record, str(png), ("1f1b", "zb-1p", "zb-2p"))
    machines = {"machine_before": before, "machine_after": _launch.machine()}
    header = (
        "# The paper's runs rehearsed (`benchmarks/rehearse_paper.py`)\n\n"
        f"Machine: {_launch.before_after(machines)}; {time.perf_counter() - started:.0f} s.\n"
    )
    markdown = header + "\n" + "\n".join(sections)
    if not args.no_write:
        paths = _launch.write_results(name, {"settings": results, "machine": list(machines.values())}, markdown)
        print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
