"""The plan's report, and the memory part `pipe.explain()` shares with it: per stage, the layers
it holds, the bytes of parameters, gradients and optimizer state per rank (by data-parallel mode
and size), M_B and M_W, and predicted F/I/W times; per schedule, the peak memory of every rank
(state + activations), whether it fits, the predicted step time and bubble; zb-auto's choice.

Records are plain JSON-able dicts (`zbcompile.planner.plan.Plan.record`); everything here formats
them. Pure Python; no torch.

State per rank: `schedules/memory_limit.state_bytes` (which `pipe.explain()` prints too) says what each data-parallel
mode holds.
"""

from __future__ import annotations

import math
from typing import Any

from zbcompile.inspect.text import format_stages, format_state_table, format_table
from zbcompile.inspect.units import seconds_text, si


def format_schedules(record: dict[str, Any]) -> str:
    """One line per schedule: peak memory per rank (state + activations, the largest rank's
    and the list), whether every rank fits, predicted step time (makespan), steady-state step
    (span) and the stage bubble; then zb-auto's choice."""
    limit = record["memory_limit_bytes"]
    largest = max([max(e["peak_bytes"]) for e in record["schedules"] if not e.get("error")] + [1.0])
    scale, unit = next(
        (f, u) for f, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")) if largest >= f or f == 1.0
    )
    header = ("schedule", "peak (max rank)", "fits", "step", "steady step", "bubble", "stage bubble",
              f"peak per rank ({unit})")
    lines = []
    for entry in record["schedules"]:
        if entry.get("error"):
            lines.append((entry["name"], "-", "no", "-", "-", "-", "-", "(below)"))
            continue
        peaks = entry["peak_bytes"]
        lines.append((
            entry["name"], si(max(peaks), "B"), "yes" if entry["fits"] else "no", seconds_text(entry["makespan"]),
            seconds_text(entry["span"]), f"{entry['bubble_rate']:.1%}", f"{entry['stage_bubble_rate']:.1%}",
            " ".join(f"{b / scale:.1f}" for b in peaks),
        ))
    errors = [f"  {e['name']}: {e['error']}" for e in record["schedules"] if e.get("error")]
    text = [
        f"schedules (memory per rank: state + activations with each action's own peak, against {si(limit, 'B')}):",
        format_table(header, lines),
        *errors,
        "step = makespan (a barrier ends every step); steady step = span (steps back to back, the paper's); "
        "stage bubble = 1 - busy / (ranks x span)",
    ]
    if record.get("allreduce_seconds"):
        how = "ring all-reduce" if record.get("data_parallel", "replicate") == "replicate" else "reduce-scatter"
        text.append(
            f"each stage's data-parallel gradient reduction ({how} over dp={record['dp']}, up to "
            f"{seconds_text(record['allreduce_seconds'])} for the largest rank's gradients all-reduced) is counted "
            "in the times above, after the stage's last W, on the link while the rank's other work goes on"
        )
    text.append(zb_auto_line(record))
    return "\n".join(text)


def zb_auto_line(record: dict[str, Any]) -> str:
    choice = record.get("zb_auto")
    if not choice:
        return "zb-auto: not planned"
    if choice.get("error"):
        return f"zb-auto would choose nothing: {choice['error']}"
    return (
        f"zb-auto would choose: {choice['description']} (steady step {seconds_text(choice['span'])}, "
        f"{choice['speedup_over_1f1b']:.3f}x 1F1B's steady-step throughput)"
        if choice.get("speedup_over_1f1b") else f"zb-auto would choose: {choice['description']}"
    )


def cut_line(cut: dict[str, Any]) -> str:
    """Where the plan cut the model, when the memory limit bound or the ranks differ."""
    return (
        f"cut: {cut['why']} (the compiler's, balanced by FLOPs, at positions {cut['compiled']}; chosen by predicted "
        f"step time under each rank's memory: {cut['chosen']}, predicted {cut['predicted_gain']:.3f}x): "
        f"{cut['reason']}"
    )


def plan_text(record: dict[str, Any]) -> str:
    """The whole plan: what was planned on what hardware, compile times, the stage table
    (`format_stages`, as `pipe.explain()` prints it), state and times per stage, the schedules."""
    hw = record["hardware"]
    efficiency = hw["pass_efficiency"] or {"all": hw["efficiency"]}
    reused = [s for s, r in enumerate(record["representative"]) if r != s]
    lines = [
        f"plan: {record['model']}, {record['stages']} stages, {record['microbatches']} microbatches of "
        f"{record['microbatch']}, dp={record['dp']} ({record['data_parallel']})"
        + (f", tp={record['tp']}" if record.get("tp", 1) > 1 else ""),
        f"hardware: {hw['name']}: {si(hw['flops'], 'FLOP/s')}, memory {si(hw['memory_bandwidth'], 'B/s')}, "
        f"link {si(hw['link_bandwidth'], 'B/s')}, {si(hw['memory'], 'B')}; efficiency "
        + ", ".join(f"{k} {v:.2f}" for k, v in efficiency.items())
        + (
            "; per rank: " + ", ".join(f"{r} {h['name']}" for r, h in enumerate(record["rank_hardware"]))
            if record.get("rank_hardware") else ""
        ),
        "compile: " + ", ".join(
            f"{k} {v:.2f}s (CPU {record.get('phase_cpu_seconds', {}).get(k, float('nan')):.2f}s)"
            for k, v in record["phase_seconds"].items()
        )
        + (f"; stages {', '.join(map(str, reused))} reuse an identical stage's programs" if reused else ""),
        "",
        format_stages(record["stage_rows"], record["tied"]),
        "",
        format_state_table(record["stage_rows"], record["dp"], record["data_parallel"]),
        f"boundary message: {seconds_text(record['comm_seconds'])} (largest boundary over the link)",
        *tensor_parallel_lines(record),
        *([cut_line(record["cut"])] if record.get("cut") else []),
        "",
        format_schedules(record),
    ]
    if record.get("menu"):
        lines += ["", menu_text(record)]
    if record.get("nearest") is not None:
        lines += ["nearest layouts of as many GPUs that fit (fewest of pp, tp, dp, data-parallel mode and "
                  "microbatch size changed, then fastest):",
                  layout_rows(record["nearest"]) if record["nearest"] else "  none", *budget_lines(record)]
    return "\n".join(lines)


def budget_lines(record: dict[str, Any]) -> list[str]:
    """Where the time budget stopped the search for the nearest layouts: what it left unpriced."""
    budget = record.get("nearest_budget") or {}
    if not budget.get("stopped"):
        return []
    return [f"  (the search stopped at its time budget, {budget['seconds']:.0f} s: {budget['layouts_skipped']} "
            "layouts not priced; a nearer or faster one may fit: `zbcompile plan --gpus` searches them all)"]


def tensor_parallel_lines(record: dict[str, Any]) -> list[str]:
    """What `tp` ranks per stage split and the seconds of their collectives per microbatch."""
    tp = record.get("tp", 1)
    if tp <= 1:
        return []
    bandwidth = record["hardware"].get("intra_node_bandwidth") or record["hardware"]["link_bandwidth"]
    per_stage = ", ".join(
        f"{row['stage']}: " + ", ".join(f"{kind} {seconds_text(row['tp_seconds'].get(kind, 0.0))}" for kind in "FI")
        for row in record["stage_rows"]
    )
    how = " with sequence parallelism" if record.get("sequence_parallel") else ""
    return [
        f"tensor parallelism: tp={tp} ranks per stage{how}; parameters, FLOPs and activations above are one tp "
        f"rank's; its collectives per microbatch on {si(bandwidth, 'B/s')} (counted in F and I, none in W): "
        + per_stage
    ]


def menu_text(record: dict[str, Any]) -> str:
    """Every schedule of the menu with no recomputation and with the fastest level that fits (or,
    where none does, the one whose peak is least): its peak against the limit, whether it fits,
    its steady step and its throughput against 1F1B's; then the fastest that fits."""
    menu = record["menu"]
    one_f_one_b = next((e for e in menu if e["schedule"] == "1f1b" and e["recompute"] == "none"), None)
    reference = one_f_one_b["step"] if one_f_one_b and math.isfinite(one_f_one_b.get("step") or math.inf) else None
    rows = []
    for e in menu:
        if e.get("error"):
            rows.append((e["schedule"], e["recompute"], "-", "-", "-", "-", e["error"][:70]))
            continue
        ratio = f"{reference / e['step']:.3f}x" if reference else "-"
        rows.append((e["schedule"], e["recompute"], si(e["peak_bytes"], "B"), "yes" if e["fits"] else "no",
                     seconds_text(e["step"]), ratio, ""))
    header = ("schedule", "recompute", "peak (max rank)", "fits", "steady step", "vs 1F1B", "")
    lines = [
        f"the menu (each schedule without recomputation and with the fastest level that fits; "
        f"against {si(record['memory_limit_bytes'], 'B')} per rank):",
        format_table(header, rows),
    ]
    chosen = record.get("menu_choice")
    if chosen is None:
        lines.append("nothing on the menu fits")
    else:
        fits = one_f_one_b is not None and one_f_one_b["fits"]
        lines.append(
            f"fastest that fits: {chosen['schedule']}, recompute {chosen['recompute']}"
            + (f", cut at {chosen['cut']['positions']}" if chosen.get("cut") else "")
            + f": steady step {seconds_text(chosen['step'])}"
            + (f", {reference / chosen['step']:.3f}x 1F1B's throughput" if reference else "")
            + ("" if fits else " (1F1B itself does not fit: the ratio is against a run that cannot happen)")
        )
    other = record.get("other_mode")
    if other and (chosen is None or other["step"] < chosen["step"]):
        lines.append(
            f"{'faster' if chosen else 'fits'} with data_parallel=\"{other['data_parallel']}\" (the same stages, "
            f"replicas and microbatches): {other['schedule']}, recompute {other['recompute']}: steady step "
            f"{seconds_text(other['step'])}"
            + (f", {reference / other['step']:.3f}x 1F1B's throughput" if reference else "")
        )
    return "\n".join(lines)


def layout_rows(layouts: list[dict[str, Any]]) -> str:
    header = ("pp", "tp", "dp", "data-parallel", "microbatches", "schedule", "recompute", "step", "tokens/s", "MFU",
              "peak/GPU")
    rows = [
        (str(o["pp"]), str(o["tp"]), str(o["dp"]), o["data_parallel"],
         f"{o['microbatches']} x {o['microbatch_size']}", o["schedule"], o["recompute"], seconds_text(o["step"]),
         si(o["tokens_per_s"]), f"{o['mfu']:.1%}", si(o["peak_bytes"], "B"))
        for o in layouts
    ]
    return format_table(header, rows)


def search_text(record: dict[str, Any]) -> str:
    """The layout search's answer: the best layouts, how the search went, what it dropped and why."""
    lines = [
        f"layouts of {record['gpus']} x {record['hardware']} ({record['gpus_per_node']} per node) for a global batch "
        f"of {record['global_batch']} samples ({record['tokens_per_sample']} tokens each), "
        f"{si(record['memory_limit_bytes'], 'B')} per GPU; fastest first:",
        layout_rows(record["layouts"]) if record["layouts"] else "  none fits",
        f"searched in {record['seconds']:.1f} s: {record['options']} schedule options, {record['priced']} priced, "
        f"{record['pruned']} spared (their bound passes the best layouts' steps)",
        "dropped:",
        *(f"  {d['count']}: {d['why']} (e.g. {'; '.join(d['examples'])})" for d in record["dropped"]),
        "step = steady step (steps back to back); MFU counts the model's FLOPs (no recomputation) at the peak "
        "FLOP/s; pipeline messages over the inter-node link, tp's collectives over the node's",
    ]
    if record.get("nearest") is not None:
        lines += [f"nearest layouts to {record['near']} that fit:",
                  layout_rows(record["nearest"]) if record["nearest"] else "  none", *budget_lines(record)]
    return "\n".join(lines)
