"""Measured per-action times of a distributed run: per-rank step records, their merge into one
Chrome trace-event file (`trace.json`, which Perfetto and chrome://tracing open) and what a
trace says per step (makespan, span, bubble). Pure Python; no torch.

Each rank appends its own file, `timeline-rank<r>.jsonl`: a header line (rank, pipeline
position, host, the clocks), then one line per step, `{"step", "schedule_version", "events":
[[action, start, end], ...], "peak_live_bytes", "moved_w": {"past_send": [...], "into_wait":
[...]}}`, times in `time.perf_counter()` seconds (`moved_w`: the W that ran elsewhere than the
schedule put them, see `runtime/step/distributed.py`). No rank waits for another to write it;
`write_trace` merges the files afterwards.

The trace: one process per rank (`pid` = global rank, named by `process_name` metadata), thread
0 "compute" (F, I, W, B) and thread 1 "communication" (SEND_*: posting the message; RECV_*: the
wait for its data when a computation needed it, zero when it had already arrived), one complete
("X") event per action of every step, named by the schedule's action text
(`<stage><kind><microbatch>`: `2F3`, `2I3` (the paper's B, the input-gradient backward), `2W3`,
`1SEND_F3`, `2RECV_F3`), with `args` {step, stage, microbatch, schedule_version} and, for a W
that ran elsewhere than the schedule put it, `moved` ("past a send" or "into a wait"). With
data-parallel replicas the communication thread also shows the gradient reductions (category
"REDUCE", named "REDUCE <stage>" from the post at the stage's last W or B to when the step had the
result, and "REDUCE (after the step)" for the gradients reduced after the drain).

Clock: `perf_counter` is CLOCK_MONOTONIC, one clock for every process of a host, so ranks on one
host line up exactly. Ranks on several hosts are aligned through each host's wall clock (the
header pairs both clocks): as good as their NTP synchronisation, typically a millisecond.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence

from zbcompile.schedules.ir import COMPUTE_KINDS, Action

TRACE_FILE = "trace.json"
_TIMELINE = "timeline-rank{}.jsonl"
_TIMELINE_RE = re.compile(r"timeline-rank(\d+)\.jsonl$")
COMPUTE_THREAD, COMM_THREAD = 0, 1
REDUCE = "REDUCE"  # the category (and name prefix) of gradient reductions over replicas
MOVED = {"past_send": "past a send", "into_wait": "into a wait"}  # a step's moved_w -> event args


def timeline_path(directory: str, rank: int) -> str:
    return os.path.join(directory, _TIMELINE.format(rank))


def start_timeline(directory: str, header: dict[str, Any]) -> str:
    """Create (or truncate) this rank's file with its header line; returns its path."""
    path = timeline_path(directory, header["rank"])
    with open(path, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
    return path


def append_step(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_timelines(directory: str) -> dict[int, tuple[dict, list[dict]]]:
    """rank -> (header, step records) for every rank file in `directory`. A half-written last
    line (a rank still running) is skipped."""
    result = {}
    for path in glob.glob(os.path.join(directory, "timeline-rank*.jsonl")):
        match = _TIMELINE_RE.search(path)
        if not match:
            continue
        header, steps = None, []
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "header" in record:
                    header = record["header"]
                else:
                    steps.append(record)
        if header is not None:
            result[int(match.group(1))] = (header, steps)
    return result


def _offsets(headers: dict[int, dict]) -> dict[int, float]:
    """Seconds to add to each rank's perf_counter times: 0 on one host, else to wall-clock time."""
    hosts = {h["host"] for h in headers.values()}
    if len(hosts) <= 1:
        return {r: 0.0 for r in headers}
    return {r: h["clock"]["time"] - h["clock"]["perf_counter"] for r, h in headers.items()}


def chrome_trace(timelines: dict[int, tuple[dict, list[dict]]]) -> dict[str, Any]:
    """The Chrome trace-event document of every rank's steps (see the module docstring)."""
    offsets = _offsets({r: h for r, (h, _) in timelines.items()})
    starts = [start + offsets[r] for r, (_, steps) in timelines.items() for s in steps for _, start, _ in s["events"]]
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    ranks = {}
    for rank, (header, steps) in sorted(timelines.items()):
        stages = ", ".join(map(str, header.get("stages", [])))
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} (stage {stages})"}}
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in ((COMPUTE_THREAD, "compute"), (COMM_THREAD, "communication")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        for step in steps:
            moved = {w: how for key, how in MOVED.items() for w in step.get("moved_w", {}).get(key, [])}
            for text, start, end in step["events"]:
                timing = {
                    "ts": round((start + offsets[rank] - origin) * 1e6, 3),
                    "dur": round(max(end - start, 0.0) * 1e6, 3),
                }
                if text.startswith(REDUCE):  # a gradient reduction over the replicas: no action of the schedule
                    args = {"step": step["step"], "schedule_version": step["schedule_version"]}
                    event = {"ph": "X", "name": text, "cat": REDUCE, "pid": rank, "tid": COMM_THREAD, **timing}
                    events.append({**event, "args": args})
                    continue
                action = Action.parse(text)
                args = {
                    "step": step["step"],
                    "stage": action.stage,
                    "microbatch": action.microbatch,
                    "schedule_version": step["schedule_version"],
                }
                if text in moved:
                    args["moved"] = moved[text]
                tid = COMPUTE_THREAD if action.is_compute else COMM_THREAD
                events.append(
                    {"ph": "X", "name": text, "cat": action.kind, "pid": rank, "tid": tid, **timing, "args": args}
                )
        ranks[str(rank)] = {
            "pp_rank": header.get("pp_rank"),
            "dp_rank": header.get("dp_rank"),
            "host": header.get("host"),
            "peak_live_bytes": max((s.get("peak_live_bytes", 0) for s in steps), default=0),
        }
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "time.perf_counter (CLOCK_MONOTONIC); ranks on several hosts aligned by wall clock",
            "hosts": sorted({h.get("host", "?") for h, _ in timelines.values()}),
            "ranks": ranks,
        },
    }


def write_trace(directory: str) -> str | None:
    """Merge the rank files in `directory` into `trace.json`; returns its path (None when no
    rank recorded anything)."""
    timelines = read_timelines(directory)
    if not timelines:
        return None
    path = os.path.join(directory, TRACE_FILE)
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)
    return path


def load_trace(directory: str) -> dict[str, Any] | None:
    """The trace of `directory`: merged afresh from the rank files when there are any (and
    written to `trace.json`), else `trace.json` as it is, else None."""
    path = write_trace(directory) or os.path.join(directory, TRACE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def action_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of the schedule's actions (not the gradient reductions)."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != REDUCE]


def reduction_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The gradient reductions over data-parallel replicas ("REDUCE <stage>": posted at the
    stage's last W or B, to when the step had them; "REDUCE (after the step)": the rest)."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == REDUCE]


def validate_trace(trace: dict[str, Any], lowered: Sequence[Sequence[Sequence[str]]]) -> list[str]:
    """Problems with `trace` (none: a valid trace-event document with one named process per rank
    and, on every rank, every action of the lowered schedule once per step). `lowered[v][p]` is
    pipeline position p's action list of schedule version v."""
    problems = []
    names = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_rank_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in action_events(trace):
        missing = [k for k in ("name", "pid", "tid", "ts", "dur") if k not in e]
        if missing or e["dur"] < 0:
            problems.append(f"event {e} lacks {missing} or has a negative duration")
            continue
        if e["pid"] not in names:
            problems.append(f"rank {e['pid']} has events but no process_name metadata")
            names.add(e["pid"])
        by_rank_step[(e["pid"], e["args"]["step"])].append(e)
    positions = {int(r): info["pp_rank"] for r, info in trace.get("otherData", {}).get("ranks", {}).items()}
    steps = sorted({step for _, step in by_rank_step})
    for step in steps:
        silent = sorted(r for r in names if (r, step) not in by_rank_step)
        if silent:
            problems.append(f"step {step}: ranks {silent} recorded no action")
    for (rank, step), events in sorted(by_rank_step.items()):
        version = events[0]["args"]["schedule_version"]
        expected = Counter(lowered[version][positions.get(rank, rank)])
        got = Counter(e["name"] for e in events)
        if got != expected:
            extra, absent = got - expected, expected - got
            problems.append(
                f"rank {rank} step {step}: actions differ from schedule version {version} "
                f"(missing {sorted(absent)[:5]}, unexpected or repeated {sorted(extra)[:5]})"
            )
    return problems


def step_stats(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per step that every rank recorded, over every rank's compute actions: makespan (first
    start to last end), span (the longest rank's own first start to last end), busy time, both
    bubble rates, per rank the busy time and the RECV waits (seconds), and how many W ran
    elsewhere than the schedule put them, over all ranks, by how (`MOVED`)."""
    steps: dict[int, list[dict]] = defaultdict(list)
    for e in action_events(trace):
        steps[e["args"]["step"]].append(e)
    ranks = sorted({e["pid"] for e in trace["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"})
    result = []
    for step, events in sorted(steps.items()):
        compute = [e for e in events if e["cat"] in COMPUTE_KINDS]
        if {e["pid"] for e in compute} != set(ranks):  # a rank is still writing it
            continue
        first = min(e["ts"] for e in compute)
        makespan = (max(e["ts"] + e["dur"] for e in compute) - first) / 1e6
        per_rank = defaultdict(list)
        for e in compute:
            per_rank[e["pid"]].append(e)
        rank_span = {
            r: (max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)) / 1e6 for r, es in per_rank.items()
        }
        busy = {r: sum(e["dur"] for e in per_rank.get(r, [])) / 1e6 for r in ranks}
        waits = {r: sum(e["dur"] for e in events if e["pid"] == r and e["cat"].startswith("RECV")) / 1e6 for r in ranks}
        span = max(rank_span.values())
        total = sum(busy.values())
        result.append(
            {
                "step": step,
                "schedule_version": compute[0]["args"]["schedule_version"],
                "start": first / 1e6,
                "makespan": makespan,
                "span": span,
                "busy": total,
                "bubble_rate": 1 - total / (len(ranks) * makespan) if makespan > 0 else 0.0,
                "stage_bubble_rate": 1 - total / (len(ranks) * span) if span > 0 else 0.0,
                "rank_busy": busy,
                "recv_wait": waits,
                "moved": {how: sum(1 for e in compute if e["args"].get("moved") == how) for how in MOVED.values()},
            }
        )
    return result


def steady_steps(stats: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of the latest schedule version, without its first step (it warms up caches and
    the allocator) when there are more."""
    if not stats:
        return []
    version = stats[-1]["schedule_version"]
    steps = [s for s in stats if s["schedule_version"] == version]
    return steps[1:] if len(steps) > 1 else steps


def median_step(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step whose makespan is the median (the lower one of an even count)."""
    ordered = sorted(steps, key=lambda s: s["makespan"])
    return ordered[(len(ordered) - 1) // 2]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))
