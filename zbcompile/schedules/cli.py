"""``zbcompile schedule``: build schedules, print their scores and grids, draw their timelines.

``--stages`` gives every schedule that many stages (chunks, for the two-chunk schedules) with the
costs as given. ``--ranks`` compares schedules of different chunk counts on the same model: the
costs are per rank-sized stage, every schedule runs on that many ranks, and a schedule with c
chunks per rank gets the model cut into c times as many chunks, each stage's costs divided by c
(``ResolvedCosts.chunked``); zb-auto may then choose the V placement (``v_choice.PLACEMENTS``)."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from .costs import Costs, ResolvedCosts
from .heuristic import one_f_one_b_peaks
from .ir import Schedule
from .registry import OBJECTIVES, SCHEDULE_NAMES, make_schedule, schedule_spec
from .render import idle_boxes, layout, to_png, to_svg
from .simulate import simulate


def _floats(text: str) -> float | list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or a comma-separated list of numbers, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def memory_limit_for(spec: str | None, name: str, stages: int, costs: Costs) -> float | list[float] | None:
    """``Np`` is N times 1F1B's peak per rank of schedule ``name``'s placement (p microbatches of
    each rank's activations, plus max(0, mem_w - mem_b) for the backward in progress,
    ``heuristic.one_f_one_b_peaks``); else a number."""
    if spec is None:
        return None
    if not spec.endswith("p"):
        return _floats(spec)
    factor = float(spec[:-1] or 1)
    placement = schedule_spec(name).placement(stages)
    return [factor * peak for peak in one_f_one_b_peaks(placement, costs.resolve(stages))]


def register(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="build, score and draw pipeline schedules", description=__doc__)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--stages", type=int, help="pipeline stages (chunks for the two-chunk schedules), costs as given")
    size.add_argument(
        "--ranks",
        type=int,
        help="pipeline ranks: costs per rank's stage, split into chunks for the two-chunk schedules",
    )
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--f", type=_floats, default=1.0, help="forward time, scalar or one per stage (1.2,1,1,1.5)")
    p.add_argument("--i", type=_floats, default=1.0, help="input-gradient backward time")
    p.add_argument("--w", type=_floats, default=1.0, help="weight-gradient backward time")
    p.add_argument("--comm", type=float, default=0.0, help="point-to-point delay between ranks")
    p.add_argument(
        "--reduce", type=_floats, default=0.0,
        help="each stage's gradient reduction over data-parallel replicas, after its last W (0: one replica)",
    )
    p.add_argument("--mem-b", type=_floats, default=1.0, help="activation memory of one microbatch (M_B)")
    p.add_argument("--mem-w", type=_floats, default=0.5, help="memory W still needs after I (M_W)")
    p.add_argument("--memory-limit", default=None, help="1p, 2p (multiples of 1F1B's peak) or a number")
    p.add_argument(
        "--schedule", default="1f1b,zb-h1,zb-h2,zb-auto", help=f"comma-separated: {','.join(SCHEDULE_NAMES)}"
    )
    p.add_argument("--objective", choices=OBJECTIVES, default="span")
    p.add_argument("--time-budget", type=float, default=None, help="zb-auto solver seconds (default 3)")
    p.add_argument("--out", default=None, help="timeline picture path (.svg; a .png is written beside it)")
    p.add_argument("--no-grid", action="store_true", help="do not print the per-rank action grid")
    p.set_defaults(func=run)


def _picture_paths(out: str, name: str, several: bool) -> tuple[str, str]:
    stem, ext = os.path.splitext(out)
    stem = f"{stem}-{name}" if several else stem
    return stem + (ext or ".svg"), stem + ".png"


def _built(name: str, args: argparse.Namespace, costs: Costs) -> tuple[Schedule, ResolvedCosts]:
    """Schedule ``name`` and the costs it runs under (per chunk with ``--ranks``)."""
    spec = schedule_spec(name)
    if args.stages is not None:
        stages, sc = args.stages, costs.resolve(args.stages)
        # only the solved schedules are shaped by a limit; the others are only measured
        limit = memory_limit_for(args.memory_limit, name, stages, costs) if spec.solved else None
        sched = make_schedule(
            name, stages, args.microbatches, sc, limit, args.objective, time_budget=args.time_budget,
            placements=("in-line",),
        )
        return sched, sc
    per_rank = costs.resolve(args.ranks)
    stages = args.ranks * spec.chunks_per_rank
    sc = per_rank.chunked(spec.chunks_per_rank) if spec.chunks_per_rank > 1 else per_rank
    limit = memory_limit_for(args.memory_limit, "1f1b", args.ranks, costs) if spec.solved else None
    sched = make_schedule(
        name, stages, args.microbatches, sc, limit, args.objective, time_budget=args.time_budget
    )
    if sched.stages != stages:  # zb-auto chose two chunks per rank
        sc = per_rank.chunked(sched.stages // args.ranks)
    return sched, sc


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.schedule.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULE_NAMES]
    if unknown:
        raise SystemExit(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULE_NAMES)}")
    costs = Costs(f=args.f, i=args.i, w=args.w, comm=args.comm, mem_b=args.mem_b, mem_w=args.mem_w, reduce=args.reduce)
    built = [_built(name, args, costs) for name in names]
    print(format_table([s for s, _ in built], [sc for _, sc in built]))
    for sched, sc in built:
        if not args.no_grid:
            print(f"\n{sched.name}:")
            print(sched.grid())
        if args.out:
            svg_path, png_path = _picture_paths(args.out, sched.name, len(built) > 1)
            boxes = layout(sched, sc)
            boxes += idle_boxes(boxes)
            res = simulate(sched, sc)
            title = (
                f"{sched.name}: p={sched.stages} m={sched.microbatches} span={res.span:.3f} makespan={res.makespan:.3f}"
            )
            with open(svg_path, "w") as fh:
                fh.write(to_svg(boxes, title, legend=True))
            to_png(boxes, png_path, title)
            print(f"wrote {svg_path} and {png_path}")
    return 0


def format_table(schedules: Sequence[Schedule], costs: Costs | ResolvedCosts | Sequence[Costs | ResolvedCosts]) -> str:
    """Ranks, chunks per rank, makespan, span, both bubble rates, peak memory, solve time and lower
    bound per schedule; ``costs`` for all or one per schedule."""
    each = list(costs) if isinstance(costs, (list, tuple)) else [costs] * len(schedules)
    header = (
        f"{'schedule':<17}{'ranks':>6}{'chunks':>7}{'makespan':>11}{'span':>11}{'bubble':>9}{'stage-bub':>10}"
        f"{'peak mem':>10}{'time s':>9}{'lower bd':>11}"
    )
    lines = [header, "-" * len(header)]
    for s, sc in zip(schedules, each):
        r = simulate(s, sc)
        bound = s.info.get("lower_bound")
        lines.append(
            f"{s.name:<17}{s.ranks:>6}{s.stages // s.ranks:>7}{r.makespan:>11.3f}{r.span:>11.3f}{r.bubble_rate:>9.4f}"
            f"{r.stage_bubble_rate:>10.4f}{max(r.peak_memory):>10.2f}{s.info.get('solve_time_s', 0.0):>9.2f}"
            f"{(f'{bound:.3f}' if bound is not None else '-'):>11}"
        )
    lines.append("bubble = 1 - busy/(ranks*makespan); stage-bub = 1 - busy/(ranks*span) (the paper's)")
    lines.append("peak mem: the largest rank's activations, in units of --mem-b (one stage's microbatch with --ranks)")
    return "\n".join(lines)
