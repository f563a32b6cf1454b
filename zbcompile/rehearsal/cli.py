"""The `zbcompile rehearse` command (`zbcompile/rehearsal/rehearse.py`):

    zbcompile rehearse --paper 1.5B [--microbatches 32] [--time-scale 4]   # the paper's Table 9 times
    zbcompile rehearse plan.json [--time-scale 0.1]     # a `zbcompile plan --json` record (scale: see --help)
    zbcompile rehearse --ranks 8 --microbatches 24 --times 18.5,18.1,9.3,0.6   # F, I, W, link (ms)

Each prints the measured steady step of every schedule beside the simulator's prediction, both
bubble rates, the gain over 1F1B, the host time per action; `--out DIR` also writes the record
(rehearsal.json) and the measured timelines (timelines.svg)."""

from __future__ import annotations

import argparse
import json
import os

from zbcompile.rehearsal.rehearse import (
    OURS,
    PAPER_TIMES,
    Rehearsal,
    paper_times,
    plan_time_scale,
    plan_times,
    rehearse,
)
from zbcompile.rehearsal.report import report_text, timeline_svg
from zbcompile.schedules import Costs


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(n for n in text.split(",") if n)


def settings_of(args: argparse.Namespace) -> Rehearsal:
    """The rehearsal the arguments ask for."""
    options = {"steps": args.steps, "rounds": args.rounds}
    if args.torch is not None:
        options["torch_schedules"] = _names(args.torch)
    if args.schedules is not None:
        options["schedules"] = _names(args.schedules)
    if args.plan is not None:
        with open(args.plan) as file:
            record = json.load(file)
        scale = plan_time_scale(record) if args.time_scale is None else args.time_scale
        return plan_times(record, scale, **options)
    if args.paper is not None:
        return paper_times(args.paper, args.microbatches, args.time_scale or 1.0, **options)
    if args.times is None or args.ranks is None or args.microbatches is None:
        raise SystemExit(
            "zbcompile rehearse: give a plan record, --paper MODEL, or --ranks, --microbatches and --times"
        )
    times = [float(t) for t in args.times.split(",")]
    if len(times) not in (3, 4):
        raise SystemExit(f"zbcompile rehearse: --times is F,I,W[,LINK] in ms, got {args.times!r}")
    costs = Costs(f=times[0], i=times[1], w=times[2], comm=times[3] if len(times) == 4 else 0.0)
    return Rehearsal(args.ranks, args.microbatches, costs, label=f"F,I,W={args.times} ms", **options)


def run(args: argparse.Namespace) -> int:
    record = rehearse(settings_of(args))
    print(report_text(record))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rehearsal.json"), "w") as file:
            json.dump(record, file, indent=1)
        with open(os.path.join(args.out, "timelines.svg"), "w") as file:
            file.write(timeline_svg(record))
        print(f"record and timelines: {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rehearse", help="run schedules on local processes with emulated action times (the paper's, a plan's)"
    )
    parser.add_argument("plan", nargs="?", default=None, help="a `zbcompile plan --json` record to rehearse")
    parser.add_argument("--paper", choices=sorted(PAPER_TIMES), help="the paper's setting (Table 9's times, ms)")
    parser.add_argument("--ranks", type=int, help="pipeline ranks (with --times)")
    parser.add_argument("--microbatches", type=int, help="microbatches (default for --paper: the paper's smallest)")
    parser.add_argument("--times", help="F,I,W[,LINK] per stage in ms")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="a plan's or the paper's times scaled by this (default: the paper's 1; a plan's 1 "
                        "where its mean action lasts 12-30 ms, else the scale that brings it to 21 ms)")
    parser.add_argument("--schedules", help=f"ours, comma-separated (default {','.join(OURS)}; zb-1p/zb-2p: "
                        "zb-auto under 1F1B's memory and twice it)")
    parser.add_argument("--torch", help="torch.distributed.pipelining's schedule classes beside them, e.g. "
                        "Schedule1F1B,ScheduleInterleavedZeroBubble,ScheduleZBVZeroBubble,ScheduleDualPipeV")
    parser.add_argument("--steps", type=int, default=5, help="steps back to back per round (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every schedule")
    parser.add_argument("--out", default=None, help="write rehearsal.json and timelines.svg here")
    parser.set_defaults(func=run)
