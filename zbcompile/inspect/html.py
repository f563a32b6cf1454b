"""One self-contained HTML page of a dump (`zbcompile inspect DIR --html report.html`): the
summary, the predicted and the measured timeline one above the other on one time scale (inline
SVG, drawn by `schedules.render` like `zbcompile schedule`), per-stage bars of time and memory,
the schedule grid and every graph listing. No scripts, no external resources.

Given the dumps of other runs of the same pipeline under other schedules (`compared=`), the page
opens with every run's measured step one above the other on one time scale, each rank's idle
time between its first and last action (the bubble) shaded: `compared_panels`, also drawn as a
PNG by `write_compared_png` (`zbcompile demo` does both).

The predicted timeline is the simulator's under the schedule's costs (static estimates put in
seconds as `inspect.text.comparison` explains); the measured one is the step whose makespan is
the median of the steady steps, every rank of the first replica, compute and communication
(SEND: posting, RECV: waiting for data) actions alike."""

from __future__ import annotations

import os
from html import escape
from typing import Any, Sequence

from zbcompile.inspect.read import Dump, graph_text, load
from zbcompile.inspect.split_diff import split_diff
from zbcompile.inspect.text import comparison, si, summary_text
from zbcompile.inspect.timelines import action_events, median
from zbcompile.schedules.ir import COMPUTE_KINDS, Action, format_grid
from zbcompile.schedules.render import COLOURS, Box, idle_boxes, to_png_panels, to_svg

_TIMELINE_WIDTH = 1200.0
_SERIES_COLOURS = {"predicted": "#9aa9c9", "measured": "#e0a060", "M_B": "#6c8ebf", "M_W": "#82b366"}


def predicted_boxes(version: dict[str, Any], scale: float) -> list[Box]:
    """The simulator's timing of every compute action, times multiplied by `scale`."""
    start, end = version["prediction"]["start"], version["prediction"]["end"]
    boxes = []
    for rank, row in enumerate(version["actions"]):
        for text in row:
            action = Action.parse(text)
            boxes.append(Box(rank, start[text] * scale, end[text] * scale, str(action.microbatch), action.kind, text))
    return boxes


def measured_boxes(trace: dict[str, Any], step: int) -> list[Box]:
    """Every action of `step` on the first replica's ranks, in ms from the step's first start."""
    ranks = trace["otherData"]["ranks"]
    events = [e for e in action_events(trace) if e["args"]["step"] == step and ranks[str(e["pid"])]["dp_rank"] == 0]
    origin = min(e["ts"] for e in events if e["cat"] in COMPUTE_KINDS)
    return [
        Box(ranks[str(e["pid"])]["pp_rank"], (e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3,
            str(e["args"]["microbatch"]), e["cat"], e["name"])
        for e in events
    ]


def compared_panels(dumps: Sequence[Dump]) -> list[tuple[str, list[Box]]]:
    """Per dump with a trace: (title, boxes) of its median steady step's compute actions (ms from
    the step's first start) and of each rank's idle gaps between them (kind `render.IDLE`)."""
    panels = []
    for run in dumps:
        version = run.versions[-1]
        found = comparison(version, run.trace)
        if found is None:
            continue
        step = found["representative"]
        compute = [b for b in measured_boxes(run.trace, step) if b.kind in COMPUTE_KINDS]
        idle = idle_boxes(compute)
        spans = [
            max(b.end for b in compute if b.rank == r) - min(b.start for b in compute if b.rank == r)
            for r in {b.rank for b in compute}
        ]
        share = sum(b.end - b.start for b in idle) / max(sum(spans), 1e-12)
        asked = run.record.get("options", {}).get("schedule", version["name"])
        ran = "" if asked == version["name"] else f"ran {version['name']} (chosen by timing), "
        title = (
            f"{asked}, step {step} (the median of {len(found['steps'])} steady steps): {ran}longest rank span "
            f"{max(spans):.1f} ms, idle {share:.0%} of the ranks' spans (shaded)"
        )
        panels.append((title, [*idle, *compute]))
    return panels


def _compared_svg(panels: Sequence[tuple[str, list[Box]]]) -> str:
    span = (min(b.start for _, boxes in panels for b in boxes), max(b.end for _, boxes in panels for b in boxes))
    return "\n".join(to_svg(boxes, title, _TIMELINE_WIDTH, span) for title, boxes in panels)


def write_compared_png(dumps: Sequence[Dump], path: str) -> str | None:
    """`compared_panels(dumps)` as a PNG at `path` (None, nothing written, without a trace)."""
    panels = compared_panels(dumps)
    if not panels:
        return None
    to_png_panels(panels, path, xlabel="ms from the step's first action")
    return path


def bar_chart(title: str, groups: Sequence[tuple[str, Sequence[tuple[str, float]]]], fmt, width: float = 560.0) -> str:
    """Horizontal bars: per group (a label) one bar per (series, value), `fmt(value)` beside it."""
    row, label_width = 16, 150
    top = max([v for _, bars in groups for _, v in bars] + [1e-30])
    height = 24 + sum(len(bars) * row + 8 for _, bars in groups)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="4" y="14" font-size="13">{escape(title)}</text>',
    ]
    y = 24
    for label, bars in groups:
        for i, (series, value) in enumerate(bars):
            w = (width - label_width - 90) * value / top
            colour = _SERIES_COLOURS.get(series, COLOURS.get(series, "#bbbbbb"))
            name = f"{label} {series}" if i == 0 else series
            out.append(f'<text x="4" y="{y + 12}">{escape(name)}</text>')
            out.append(
                f'<rect class="bar" data-series="{escape(series)}" data-group="{escape(label)}" x="{label_width}" '
                f'y="{y + 2}" width="{max(w, 0.5):.2f}" height="{row - 4}" fill="{colour}"/>'
            )
            out.append(f'<text x="{label_width + w + 4:.2f}" y="{y + 12}">{escape(fmt(value))}</text>')
            y += row
        y += 8
    out.append("</svg>")
    return "\n".join(out)


def _measured_action_times(trace: dict[str, Any], steps: Sequence[int]) -> dict[tuple[int, str], float]:
    """(stage, kind) -> median seconds of that action over `steps`."""
    chosen = set(steps)
    samples: dict[tuple[int, str], list[float]] = {}
    for e in action_events(trace):
        if e["args"]["step"] in chosen and e["cat"] in COMPUTE_KINDS:
            samples.setdefault((e["args"]["stage"], e["cat"]), []).append(e["dur"] / 1e6)
    return {k: median(v) for k, v in samples.items()}


def _timelines(dump: Dump, version: dict[str, Any], found: dict[str, Any] | None) -> str:
    unit = version["time_unit"]
    if found is None:
        label, scale = ("ms", 1e3) if unit == "s" else ("FLOP-equivalents", 1.0)
        title = f"predicted ({label}): {version['name']}"
        return to_svg(predicted_boxes(version, scale), title, _TIMELINE_WIDTH) + "<p>measured: no trace recorded</p>"
    predicted = predicted_boxes(version, found["scale"] * 1e3)
    measured = measured_boxes(dump.trace, found["representative"])
    # both from the first compute action; a RECV wait may begin before it
    span = (min([0.0, *(b.start for b in measured)]), max(b.end for b in [*predicted, *measured]))
    panels = [
        (predicted, f"predicted (ms): makespan {found['predicted_makespan'] * 1e3:.2f} ms"),
        (measured, f"measured, step {found['representative']} (ms; grey: SEND posts and RECV waits): makespan of the "
         "median step"),
    ]
    return "\n".join(to_svg(boxes, title, _TIMELINE_WIDTH, span) for boxes, title in panels)


def _bars(dump: Dump, version: dict[str, Any], found: dict[str, Any] | None) -> str:
    record, costs = dump.record, version["costs"]
    scale = found["scale"] if found else 1.0
    in_seconds = found is not None or version["time_unit"] == "s"
    fmt_time = (lambda v: f"{v * 1e3:.3f} ms") if in_seconds else si
    measured = _measured_action_times(dump.trace, found["steps"]) if found else {}
    time_groups = []
    for s in range(version["stages"]):
        for kind, key in (("F", "f"), ("I", "i"), ("W", "w")):
            bars = [("predicted", costs[key][s] * scale)]
            if (s, kind) in measured:
                bars.append(("measured", measured[(s, kind)]))
            time_groups.append((f"stage {s} {kind}", bars))
    memory_groups = [
        (f"stage {row['stage']}", [("M_B", row["mem_b"]), ("M_W", row["mem_w"])]) for row in record["stage_rows"]
    ]
    peak_groups = []
    for rank, peak in enumerate(version["prediction"]["peak_memory_bytes"]):
        bars = [("predicted", peak)]
        if found and rank < len(found["peak_live_bytes"]):
            bars.append(("measured", found["peak_live_bytes"][rank]))
        peak_groups.append((f"rank {rank} peak", bars))
    return "\n".join(
        [
            bar_chart("time per microbatch and action", time_groups, fmt_time),
            bar_chart("activation memory per microbatch (bytes)", memory_groups, lambda v: si(v, "B")),
            bar_chart("peak activation memory per rank", peak_groups, lambda v: si(v, "B")),
        ]
    )


def _listings(dump: Dump) -> str:
    def details(summary: str, text: str) -> str:
        return f"<details><summary>{summary}</summary><pre>{escape(text)}</pre></details>"

    parts = [details("traced forward with stages", graph_text(dump, None, "forward"))]
    for s in range(dump.record["stages"]):
        parts += [details(f"stage {s} {graph}", graph_text(dump, s, graph)) for graph in ("F", "I", "W", "B")]
    parts.append(details("the backward before and after the I/W split", split_diff(dump)))
    return "\n".join(parts)


_STYLE = """
body { font-family: sans-serif; margin: 16px; color: #222; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
.ratio { font-size: 18px; font-weight: bold; }
.bars { display: flex; flex-wrap: wrap; gap: 16px; }
summary { cursor: pointer; margin: 4px 0; }
"""


def report_html(dump: Dump, compared: Sequence[Dump] = ()) -> str:
    """The page (see the module docstring); `compared`: dumps of other schedules' runs to draw
    above it, measured step against measured step."""
    version = dump.versions[-1]
    found = comparison(version, dump.trace)
    headline = (
        f'<p class="ratio">measured / predicted makespan: {found["ratio"]:.2f} '
        f'({found["makespan"] * 1e3:.2f} ms measured, {found["predicted_makespan"] * 1e3:.2f} ms predicted)</p>'
        if found
        else '<p class="ratio">measured: no trace recorded (run distributed with a dump directory)</p>'
    )
    grid = format_grid(version["actions"])
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html><head><meta charset="utf-8">',
            f"<title>zbcompile report: {escape(dump.record['model'])}</title>",
            f"<style>{_STYLE}</style></head><body>",
            f"<h1>zbcompile: {escape(dump.record['model'])}, {dump.record['stages']} stages, schedule "
            f"{escape(version['name'])}</h1>",
            headline,
            _compared_section([*compared, dump]) if compared else "",
            "<h2>Timelines</h2>",
            f'<div class="timelines">{_timelines(dump, version, found)}</div>',
            "<h2>Per stage</h2>",
            f'<div class="bars">{_bars(dump, version, found)}</div>',
            "<h2>Summary</h2>",
            f"<pre>{escape(summary_text(dump))}</pre>",
            "<h2>Schedule (per rank, in order)</h2>",
            f"<pre>{escape(grid)}</pre>",
            "<h2>Graphs</h2>",
            _listings(dump),
            "</body></html>",
        ]
    )


def _compared_section(dumps: Sequence[Dump]) -> str:
    panels = compared_panels(dumps)
    if not panels:
        return "<p>schedules compared: no trace recorded</p>"
    return "\n".join(
        [
            "<h2>Measured steps, schedule against schedule</h2>",
            "<p>One time scale, in ms from each step's first action; shaded: a rank idle between its first and last "
            "action (the bubble).</p>",
            f'<div class="timelines">{_compared_svg(panels)}</div>',
        ]
    )


def write_report(dump: Dump | str, path: str, compared: Sequence[Dump | str] = ()) -> str:
    """Write the report of `dump` (a loaded dump or a dump directory) to `path`, with the
    measured steps of `compared` (the same) drawn above it; returns `path`."""
    if isinstance(dump, str):
        dump = load(dump)
    others = [load(d) if isinstance(d, str) else d for d in compared]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(report_html(dump, others))
    return path
