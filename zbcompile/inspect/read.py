"""`zbcompile inspect DIR` and `pipe.explain()`: what the compiler did, read back from a dump
(see `zbcompile.dump`): stages, balance, costs, the schedule's predicted makespan and bubble
against the measured ones, single graphs, the backward before and after the I/W split, and an
HTML report (`zbcompile.report`).

    zbcompile inspect DIR                      the summary (DIR: a dump root or one compile-<n> in it)
    zbcompile inspect DIR --stage 2 --graph W  one graph (F, I, W, backward; `--graph forward` the traced forward)
    zbcompile inspect DIR --diff [--stage 2]   the backward before and after the split
    zbcompile inspect DIR --html report.html   the report

Pure Python: reads JSON and text, imports no torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from zbcompile import summary, trace_events
from zbcompile.summary import si

GRAPHS = ("F", "I", "W", "backward", "forward")
_NO_TRACE = "none (per-action times are recorded in distributed runs with pipeline(dump_dir=...) or ZBCOMPILE_DUMP)"


@dataclass(frozen=True)
class Dump:
    """One compile's record (`compile.json`), its schedule versions (`schedule.json`) and the
    measured trace (None when nothing ran distributed yet)."""

    directory: str | None
    record: dict[str, Any]
    versions: list[dict[str, Any]]
    trace: dict[str, Any] | None


def compile_dir(path: str) -> str:
    """`path` itself when it holds a compile, else its newest `compile-<n>`."""
    from zbcompile.dump import COMPILE_FILE

    if os.path.exists(os.path.join(path, COMPILE_FILE)):
        return path
    found = []
    if os.path.isdir(path):
        for name in os.listdir(path):
            match = re.fullmatch(r"compile-(\d+)", name)
            if match and os.path.exists(os.path.join(path, name, COMPILE_FILE)):
                found.append((int(match.group(1)), name))
    if not found:
        raise ValueError(
            f"{path} is not a zbcompile dump: it has no {COMPILE_FILE} and no compile-<n> directory with one. "
            "Write one with ZBCOMPILE_DUMP=DIR or pipeline(..., dump_dir=DIR)."
        )
    return os.path.join(path, max(found)[1])


def load(path: str) -> Dump:
    """Read a dump; rank timelines are merged into `trace.json` on the way."""
    from zbcompile.dump import COMPILE_FILE, SCHEDULE_FILE

    directory = compile_dir(path)
    with open(os.path.join(directory, COMPILE_FILE)) as f:
        record = json.load(f)
    with open(os.path.join(directory, SCHEDULE_FILE)) as f:
        versions = json.load(f)["versions"]
    return Dump(directory, record, versions, trace_events.load_trace(directory))


# --- the summary -------------------------------------------------------------------------------


def _time(value: float, unit: str) -> str:
    return f"{value * 1e3:.2f} ms" if unit == "s" else si(value)


def _rates(bubble: float, stage_bubble: float) -> str:
    return f"bubble {bubble:.1%} (stage bubble {stage_bubble:.1%})"


def format_schedule(version: dict[str, Any], count: int = 1, memory_unit: int | None = None) -> str:
    """The schedule's costs and the simulator's prediction under them."""
    unit, costs, predicted = version["time_unit"], version["costs"], version["prediction"]
    ranks = len(version["actions"])
    placement = ", ".join(f"{s}->{r}" for s, r in enumerate(version["stage_to_rank"]))
    source = {
        "measured": "measured on this machine (seconds)",
        "given": "given to pipeline(costs=...)",
    }.get(version["cost_source"], "static estimates in FLOP-equivalents (FLOPs + 4 x bytes written)")
    lines = [
        f"schedule {version['name']} (version {version['version']} of {count}), {ranks} ranks (stage->rank {placement}), "
        f"{version['microbatches']} microbatches",
        f"costs: {source}, comm {_time(costs['comm'], unit)}",
    ]
    unit_bytes = memory_unit or 1
    rows = [
        (
            str(s),
            _time(costs["f"][s], unit),
            _time(costs["i"][s], unit),
            _time(costs["w"][s], unit),
            si(costs["mem_b"][s] * unit_bytes, "B") if memory_unit else f"{costs['mem_b'][s]:.2f}",
            si(costs["mem_w"][s] * unit_bytes, "B") if memory_unit else f"{costs['mem_w'][s]:.2f}",
        )
        for s in range(version["stages"])
    ]
    lines.append(summary.format_table(("stage", "F", "I", "W", "M_B", "M_W"), rows))
    peaks = ", ".join(si(b, "B") for b in predicted["peak_memory_bytes"])
    lines.append(
        f"predicted: makespan {_time(predicted['makespan'], unit)}, span {_time(predicted['span'], unit)}, "
        f"{_rates(predicted['bubble_rate'], predicted['stage_bubble_rate'])}; peak activations per rank {peaks}"
    )
    return "\n".join(lines)


def _balance(version: dict[str, Any]) -> str:
    costs = version["costs"]
    work = [f + i + w for f, i, w in zip(costs["f"], costs["i"], costs["w"])]
    top = max(work) or 1.0
    slowest = work.index(max(work))
    return (
        f"balance: F+I+W per stage relative to the slowest (the schedule's costs): "
        f"{', '.join(f'{x / top:.2f}' for x in work)}; stage {slowest} sets the pace"
    )


def comparison(version: dict[str, Any], trace: dict[str, Any] | None) -> dict[str, Any] | None:
    """Measured against predicted for the latest schedule version: the steady steps' medians,
    the predicted makespan in seconds and measured / predicted. Static estimates are put in
    seconds by one factor, measured busy time / predicted busy time, so the ratio reflects how
    well the timing (order, overlap, bubbles) was predicted, not the FLOP rate."""
    if trace is None:
        return None
    stats = [s for s in trace_events.step_stats(trace) if s["schedule_version"] == version["version"]]
    steps = trace_events.steady_steps(stats)
    if not steps:
        return None
    predicted = version["prediction"]
    busy = trace_events.median(s["busy"] for s in steps)
    scale = 1.0 if version["time_unit"] == "s" else busy / max(sum(predicted["busy"]), 1e-30)
    makespan = trace_events.median(s["makespan"] for s in steps)
    ranks = sorted(steps[0]["rank_busy"])
    return {
        "steps": [s["step"] for s in steps],
        "makespan": makespan,
        "span": trace_events.median(s["span"] for s in steps),
        "bubble_rate": trace_events.median(s["bubble_rate"] for s in steps),
        "stage_bubble_rate": trace_events.median(s["stage_bubble_rate"] for s in steps),
        "rank_busy": [trace_events.median(s["rank_busy"][r] for s in steps) for r in ranks],
        "recv_wait": [trace_events.median(s["recv_wait"][r] for s in steps) for r in ranks],
        "moved": {how: trace_events.median(s.get("moved", {}).get(how, 0) for s in steps) for how in trace_events.MOVED.values()},
        "scale": scale,
        "predicted_makespan": predicted["makespan"] * scale,
        "ratio": makespan / (predicted["makespan"] * scale) if predicted["makespan"] > 0 else float("nan"),
        "representative": trace_events.median_step(steps)["step"],
        "peak_live_bytes": [info["peak_live_bytes"] for _, info in sorted(trace["otherData"]["ranks"].items(), key=lambda kv: int(kv[0]))],
    }


def format_measured(version: dict[str, Any], trace: dict[str, Any] | None) -> str:
    found = comparison(version, trace)
    if found is None:
        return f"measured: {_NO_TRACE}"
    steps = found["steps"]
    how = (
        "the schedule's measured costs, in seconds"
        if version["time_unit"] == "s"
        else f"static estimates put in seconds so that predicted busy time equals measured: {found['scale'] * 1e9:.3g} ns per FLOP-eq"
    )
    return "\n".join(
        [
            f"measured: {len(steps)} steps of version {version['version']} (steps {steps[0]}-{steps[-1]}; a schedule's first step "
            "warms up and is left out), medians:",
            f"  makespan {found['makespan'] * 1e3:.2f} ms, span {found['span'] * 1e3:.2f} ms, "
            f"{_rates(found['bubble_rate'], found['stage_bubble_rate'])}",
            f"  per rank: busy {', '.join(f'{b * 1e3:.2f}' for b in found['rank_busy'])} ms; waiting on RECV "
            f"{', '.join(f'{w * 1e3:.2f}' for w in found['recv_wait'])} ms; peak live activations "
            f"{', '.join(si(b, 'B') for b in found['peak_live_bytes'])}",
            "  W run elsewhere than the schedule put them, per step (all ranks): "
            + ", ".join(f"{count:g} {how}" for how, count in found["moved"].items()),
            f"  predicted makespan {found['predicted_makespan'] * 1e3:.2f} ms ({how})",
            f"  measured / predicted makespan = {found['ratio']:.2f}",
        ]
    )


def summary_text(dump: Dump) -> str:
    """Stages, balance, costs, predicted against measured makespan and bubble."""
    record = dump.record
    world = record["world"]
    version = dump.versions[-1]
    where = f"{world['world_size']} processes" if world["distributed"] else "one process"
    lines = [
        f"{record['model']}: {record['stages']} stages, {record['microbatches']} microbatches, "
        f"schedule {version['name']} on {len(version['actions'])} ranks ({where})",
        summary.format_phases(record["phase_seconds"]),
        "",
        summary.format_stages(record["stage_rows"], record["tied"]),
        _balance(version),
        "",
        format_schedule(version, len(dump.versions), record["memory_unit"]),
        format_measured(version, dump.trace),
        "bubble = 1 - busy / (ranks x makespan); stage bubble = 1 - busy / (ranks x span), the paper's",
    ]
    return "\n".join(lines)


# --- graphs ----------------------------------------------------------------------------------


def graph_text(dump: Dump, stage: int | None, graph: str) -> str:
    """The code of one graph: `graph` in F, I, W, backward (of `stage`) or forward (the traced
    forward with every node's stage)."""
    from zbcompile.dump import GRAPH_FILES, stage_dir

    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; choose one of {', '.join(GRAPHS)}")
    if graph == "forward":
        path = os.path.join(dump.directory, "forward.py")
    else:
        stages = dump.record["stages"]
        if stage is None or not 0 <= stage < stages:
            raise ValueError(f"--graph {graph} needs --stage between 0 and {stages - 1} (this pipeline has {stages} stages), got {stage}")
        path = os.path.join(stage_dir(dump.directory, stage), GRAPH_FILES[graph])
    with open(path) as f:
        return f.read()


_ASSIGNMENT = re.compile(r'^\s+(\w+)(?:: "[^"]*")? = (.*?)(\s+#.*)?$')


def _operations(code: str) -> dict[str, str]:
    """Node name -> its right-hand side, in graph order, from `dump.readable_code` output."""
    ops = {}
    for line in code.splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            ops[match.group(1)] = match.group(2).replace("torch.ops.", "")
    return ops


def _returns(code: str) -> list[str]:
    """The environment names a graph returns, from its code's header."""
    lines = code.splitlines()
    after = lines[lines.index("# returns, in order:") + 1 :]
    names = [line.removeprefix("#").strip() for line in itertools.takewhile(lambda line: line.startswith("#   "), after)]
    return [n for n in names if n != "(nothing)"]


def split_diff(dump: Dump, stage: int | None = None) -> str:
    """Per stage, every operation of the unsplit backward marked with where it went (I, W or
    both: recomputed), operations I or W compute differently (a fused op asked for part of its
    outputs), the ones they add (W's copy of such an op, which takes over outputs of the
    original) and what each returns."""
    stages = range(dump.record["stages"]) if stage is None else [stage]
    blocks = []
    for s in stages:
        code = {g: graph_text(dump, s, g) for g in ("backward", "I", "W")}
        ops = {g: _operations(text) for g, text in code.items()}
        whole, i, w = ops["backward"], ops["I"], ops["W"]
        lines = [f"stage {s}: the backward ({len(whole)} ops) split into I ({len(i)} ops) and W ({len(w)} ops)", "  I W  op"]
        added = [(g, name, rhs) for g, graph_ops in (("I", i), ("W", w)) for name, rhs in graph_ops.items() if name not in whole]
        for name, rhs in whole.items():
            mark = f"  {'I' if name in i else ' '} {'W' if name in w else ' '}"
            if name not in i and name not in w:
                mark = "  - -"
                rhs += "  (in neither: computed by an added copy below)" if added else "  (in neither: unused)"
            lines.append(f"{mark}  {name} = {rhs}")
            for g, graph_ops in (("I", i), ("W", w)):
                if name in graph_ops and graph_ops[name].replace("stash_", "") != rhs:
                    lines.append(f"         {g} computes: {graph_ops[name]}")
        for g, name, rhs in added:
            lines.append(f"  +{g}   {name} = {rhs}  (not in the unsplit backward)")
        for g in ("I", "W"):
            lines.append(f"  {g} returns: {', '.join(_returns(code[g])) or '(nothing)'}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --- pipe.explain() ----------------------------------------------------------------------------


def explain(pipe: Any, compile_dump: Any = None) -> str:
    """The summary `zbcompile inspect` prints, for `pipe`'s latest compile, from memory; the
    measured part comes from `compile_dump`'s rank timelines (every rank's that has written)."""
    from zbcompile import dump as dumps

    compiled, schedule = pipe.compiled, pipe.schedule
    record = dumps.compile_record(compiled, pipe.options, dumps.world_of(pipe.runner, schedule))
    if compile_dump is not None:
        versions = list(compile_dump.records)
    else:
        from zbcompile.api import memory_unit

        costs, source = dumps.schedule_costs_used(schedule, compiled, pipe.measured_costs)
        versions = [dumps.schedule_record(schedule, costs, source, memory_unit(compiled), 0)]
    trace = None
    if compile_dump is not None:
        timelines = trace_events.read_timelines(compile_dump.directory)
        trace = trace_events.chrome_trace(timelines) if timelines else None
    return summary_text(Dump(getattr(compile_dump, "directory", None), record, versions, trace))


# --- the command -----------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("inspect", help="what the compiler did: summary, graphs, split, report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="a dump: ZBCOMPILE_DUMP's directory or one compile-<n> in it")
    parser.add_argument("--stage", type=int, default=None, help="the stage of --graph (or of --diff)")
    parser.add_argument("--graph", choices=GRAPHS, default=None, help="print one graph")
    parser.add_argument("--diff", action="store_true", help="the backward before and after the I/W split")
    parser.add_argument("--html", default=None, metavar="PATH", help="write the HTML report there")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        dump = load(args.dir)
        if args.graph:
            print(graph_text(dump, args.stage, args.graph), end="")
        elif args.diff:
            if args.stage is not None and not 0 <= args.stage < dump.record["stages"]:
                raise ValueError(f"--stage {args.stage} does not exist: this pipeline has stages 0..{dump.record['stages'] - 1}")
            print(split_diff(dump, args.stage))
        else:
            print(f"{dump.directory}\n")
            print(summary_text(dump))
            if dump.trace is not None:
                print(f"\ntrace (Perfetto, chrome://tracing): {os.path.join(dump.directory, trace_events.TRACE_FILE)}")
        if args.html:
            from zbcompile import report

            print(f"report: {report.write_report(dump, args.html)}")
    except ValueError as error:
        print(f"zbcompile inspect: {error}", file=sys.stderr)
        return 2
    return 0
