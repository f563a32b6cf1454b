"""A rehearsal's measurements (`zbcompile/rehearsal/rehearse.py`) turned into its record, its text and its
timeline picture. Pure Python; no torch.

Per schedule: the measured steady step (the slowest rank's seconds between step ends, steps back
to back; the median over rounds) beside the simulator's span for the same times; two bubble
rates, each measured and predicted: the paper's (1 - busy / (ranks x steady step), per stage, as
Table 5) and ours (1 - busy / (ranks x makespan), one step's first start to last end); the host
time per action (a rank's own span less its actions' and its waits' time, per action: what the
runtime spends between actions); how much longer than emulated the actions ran (the sleeps'
overshoot); the simulator's span with every action as long as it ran (its overshoot and the host
time after it added: what the order itself delivers, whatever the load on the cores); and the
throughput over 1F1B's, measured (paired by round) and predicted, with the share of the predicted
gain the run captured."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from zbcompile.inspect.text import format_table
from zbcompile.inspect.timelines import REDUCE
from zbcompile.measure import median, paired_ratio
from zbcompile.schedules import Action, simulate
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.render import Box, idle_boxes, to_png_panels, to_svg

REFERENCE = "1f1b"


def _rank_timing(timeline: Mapping[str, list], costs: Any, unit_s: float) -> dict[str, float]:
    """One rank's last step: its span, busy and waiting seconds, host seconds between actions,
    and the actions' overshoot over their emulated time."""
    compute, comm = timeline["compute"], timeline["comm"]
    if not compute:
        return {"span": 0.0, "actions": 0, "host": 0.0, "overshoot": 0.0, "start": 0.0, "end": 0.0, "reduced": 0.0}
    start, end = min(s for _, s, _ in compute), max(e for _, _, e in compute)
    reduced = max([end, *(e for text, _, e in comm if text.startswith(REDUCE))])
    ran = sum(e - s for _, s, e in compute)
    waits = sum(e - s for text, s, e in comm if "RECV" in text and start <= s and e <= end)
    emulated = 0.0
    for text, _, _ in compute:
        action = Action.parse(text)
        emulated += costs.duration(action.stage, action.kind.value) * unit_s
    return {
        "span": end - start,
        "actions": len(compute),
        "host": max(0.0, end - start - ran - waits),
        "overshoot": ran - emulated,
        "start": start,
        "end": end,
        "reduced": reduced,  # the end of its last gradient reduction (emulated replicas), else of its last action
    }


def _as_ran(costs: Any, extra_units: float) -> Any:
    """`costs` with every action `extra_units` longer (a fused B: I and W each, so twice)."""
    def longer(times: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(t + extra_units for t in times)

    return replace(costs, f=longer(costs.f), i=longer(costs.i), w=longer(costs.w))


def _ours(prepared: Any, unit_s: float, timelines: Sequence[Mapping[str, list]]) -> dict[str, Any]:
    sim = simulate(prepared.schedule, prepared.costs)
    ranks = [_rank_timing(t, prepared.costs, unit_s) for t in timelines]
    actions = sum(r["actions"] for r in ranks)
    makespan = max(r["reduced"] for r in ranks) - min(r["start"] for r in ranks)
    host = sum(r["host"] for r in ranks) / max(actions, 1)
    overshoot = sum(r["overshoot"] for r in ranks) / max(actions, 1)
    as_ran = simulate(prepared.schedule, _as_ran(prepared.costs, (host + max(overshoot, 0.0)) / unit_s))
    return {
        "predicted_s": sim.span * unit_s,
        "predicted_makespan_s": sim.makespan * unit_s,
        "busy_s": [b * unit_s for b in sim.busy],
        "bubble_predicted": sim.stage_bubble_rate,
        "makespan_s": makespan,
        "bubble_ours_predicted": sim.bubble_rate,
        "host_per_action_s": host,
        "predicted_as_ran_s": as_ran.span * unit_s,
        "overshoot_per_action_s": overshoot,
        "schedule_stages": prepared.schedule.stages,
        "reduces": prepared.costs.reduces,
        "reduce_tail_s": (sim.span - _without_reduction(prepared).span) * unit_s if prepared.costs.reduces else 0.0,
        **prepared.extra,
    }


def _without_reduction(prepared: Any) -> Any:
    """The simulator's result for `prepared` with no gradient reduction."""
    return simulate(prepared.schedule, replace(prepared.costs, reduce=()))


def _torch_busy(settings: Any, name: str) -> list[float]:
    """Each rank's busy seconds under torch's schedule `name`: its chunks' F + I + W per microbatch."""
    per_stage = resolve_costs(settings.costs, settings.ranks)
    work = sum(per_stage.work(s) for s in range(settings.ranks)) / settings.ranks
    return [work * settings.microbatches * settings.unit_s] * settings.ranks


def analyse(settings: Any, prepared: Sequence[Any], per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The record of a rehearsal: `settings` (a `Rehearsal`), our `prepared` schedules, and what
    each rank measured (`rehearsal._rank_main`)."""
    ours = {p.name: p for p in prepared}
    rows: dict[str, dict[str, Any]] = {}
    for key in per_rank[0]["periods"]:
        rounds = [max(r["periods"][key][i] for r in per_rank) for i in range(settings.rounds)]
        row: dict[str, Any] = {"name": key, "library": "zbcompile" if key in ours else "torch", "rounds_s": rounds}
        row["measured_s"] = median(rounds)
        if key in ours:
            row.update(_ours(ours[key], settings.unit_s, [r["timelines"][key][-1] for r in per_rank]))
            row["bubble_ours"] = 1.0 - sum(row["busy_s"]) / (settings.ranks * row["makespan_s"])
        else:
            row["busy_s"] = _torch_busy(settings, key.removeprefix("torch "))
        row["bubble"] = 1.0 - sum(row["busy_s"]) / (settings.ranks * row["measured_s"])
        row["busy_bound_s"] = max(row["busy_s"])
        rows[key] = row
    reference = rows.get(REFERENCE)
    for row in rows.values():
        if reference is None:
            break
        row["gain"] = paired_ratio(reference["rounds_s"], row["rounds_s"])
        if "predicted_s" in row:
            row["gain_predicted"] = reference["predicted_s"] / row["predicted_s"]
            hoped = row["gain_predicted"] - 1.0
            row["captured"] = (row["gain"] - 1.0) / hoped if abs(hoped) > 1e-9 else None
    return {
        "label": settings.label,
        "ranks": settings.ranks,
        "microbatches": settings.microbatches,
        "unit_s": settings.unit_s,
        "steps": settings.steps,
        "rounds": settings.rounds,
        "rows": list(rows.values()),
        "timelines": {p.name: [r["timelines"][p.name][-1] for r in per_rank] for p in prepared},
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def report_text(record: Mapping[str, Any]) -> str:
    """The rehearsal's table: per schedule, measured against predicted."""
    header = [
        "schedule", "step ms", "predicted", "as ran", "bubble", "predicted", "bubble (ours)", "predicted", "x 1F1B",
        "predicted", "captured", "host us/action", "overshoot us",
    ]
    lines = []
    for r in record["rows"]:
        lines.append([
            r["name"], _ms(r["measured_s"]), _ms(r.get("predicted_s")), _ms(r.get("predicted_as_ran_s")),
            _pct(r["bubble"]),
            _pct(r.get("bubble_predicted")), _pct(r.get("bubble_ours")), _pct(r.get("bubble_ours_predicted")),
            f"{r['gain']:.3f}" if "gain" in r else "-",
            f"{r['gain_predicted']:.3f}" if "gain_predicted" in r else "-",
            _pct(r.get("captured")),
            "-" if "host_per_action_s" not in r else f"{r['host_per_action_s'] * 1e6:.0f}",
            "-" if "overshoot_per_action_s" not in r else f"{r['overshoot_per_action_s'] * 1e6:.0f}",
        ])
    title = (
        f"Rehearsal {record['label']}: {record['ranks']} ranks, m={record['microbatches']}, "
        f"{record['steps']} steps x {record['rounds']} rounds per schedule"
    )
    notes = (
        "step: the slowest rank's seconds per step, steps back to back (median of rounds); predicted: the "
        "simulator's span for the same times; as ran: the same with every action as long as it ran (its "
        "overshoot and the host time after it added); bubble: 1 - busy / (ranks x step), the paper's; "
        "bubble (ours): over one step's makespan; "
        "x 1F1B: throughput over 1F1B's, measured paired by round; captured: the share of the predicted gain "
        "measured; host: a rank's time between its actions and waits, per action; overshoot: how much longer "
        "than emulated the actions ran."
    )
    return title + "\n" + format_table(header, lines) + "\n" + notes + plan_text(record)


def plan_text(record: Mapping[str, Any]) -> str:
    """Where the rehearsal runs a plan's schedules: per schedule the plan's predicted step, the
    rehearsal's simulator on the same times, the measured step, measured over planned; and what
    the plan's step and the rehearsal contain (empty for other rehearsals)."""
    rows = [r for r in record["rows"] if r.get("plan_s")]
    if not rows:
        return ""
    header = ["schedule", "plan ms", "simulator ms", "measured ms", "measured / plan", "reduction tail ms"]
    lines = [
        [r["name"], _ms(r["plan_s"]), _ms(r["predicted_s"]), _ms(r["measured_s"]),
         f"{r['measured_s'] / r['plan_s']:.3f}", _ms(r["reduce_tail_s"]) if r["reduces"] else "-"]
        for r in rows
    ]
    reduced = any(r["reduces"] for r in rows)
    both = (
        "F, I, W at the plan's times (its recomputation in them), the messages at its link time, the stages' "
        "(chunks') placement"
    )
    if reduced:
        both += (
            ", each stage's gradient reduction over the replicas at the plan's time (emulated: a timed wait on the "
            "rank's own link from the stage's last W, in that order, the step ending when the last has; the "
            "replicas taken to run in step, as the plan assumes)"
        )
    left_out = sorted({what for r in rows for what in r.get("left_out", ())})
    return (
        "\nThe plan's schedules (plan: its predicted step; simulator: the rehearsal's prediction on the same times; "
        "reduction tail: how much the reductions add to the simulated step):\n" + format_table(header, lines)
        + f"\nIn both: {both}.\nIn neither: the optimizer step (the plan prices none)."
        + (f"\nIn the plan only: {'; '.join(left_out)}." if left_out else "")
    )


def timeline_panels(record: Mapping[str, Any], names: Sequence[str] | None = None) -> list[tuple[str, list[Box]]]:
    """Per schedule of ours (`names`, default all), its last measured step on every rank as
    boxes (ms from the step's first action, idle gaps shaded), titled."""
    panels = []
    for name, timelines in record["timelines"].items():
        if names is not None and name not in names:
            continue
        compute = [(rank, text, s, e) for rank, t in enumerate(timelines) for text, s, e in t["compute"]]
        if not compute:
            continue
        origin = min(s for _, _, s, _ in compute)
        boxes = []
        for rank, text, s, e in compute:
            action = Action.parse(text)
            start, end = (s - origin) * 1e3, (e - origin) * 1e3
            boxes.append(Box(rank, start, end, str(action.microbatch), action.kind.value, text))
        panels.append((f"{record['label']}: {name} (a measured step)", [*idle_boxes(boxes), *boxes]))
    return panels


def timeline_svg(record: Mapping[str, Any], width: float = 1200.0) -> str:
    """`timeline_panels` as SVG documents on one time scale (ms)."""
    panels = timeline_panels(record)
    if not panels:
        return ""
    end = max(b.end for _, boxes in panels for b in boxes)
    return "\n".join(to_svg(boxes, title, width, (0.0, end)) for title, boxes in panels)


def write_timeline_png(record: Mapping[str, Any], path: str, names: Sequence[str] | None = None) -> str | None:
    """`timeline_panels` (of `names`) as one PNG at `path`; None (nothing written) without timelines."""
    panels = timeline_panels(record, names)
    if not panels:
        return None
    to_png_panels(panels, path, xlabel="ms from the step's first action")
    return path
