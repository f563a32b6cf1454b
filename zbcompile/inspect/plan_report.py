"""The plan's report, and the memory part `pipe.explain()` shares with it: per stage, the layers
it holds, the bytes of parameters, gradients and optimizer state per rank (by data-parallel mode
and size), M_B and M_W, and predicted F/I/W times; per schedule, the peak memory of every rank
(state + activations), whether it fits, the predicted step time and bubble; zb-auto's choice.

Records are plain JSON-able dicts (`zbcompile.planning.Plan.record`); everything here formats
them. Pure Python; no torch.

State per rank of a stage with P bytes of parameters, in a step (AdamW by default: two moments
per parameter in the parameter's dtype, `optimizer_factor=2`; gradients in the parameters' dtype,
`grad_factor=1`):

    replicate  parameters P, gradients P x grad_factor, optimizer state P x optimizer_factor
    shard      the stored parameters, gradients and optimizer state divided over the dp ranks (a
               DTensor shard each, as FSDP2 keeps them), plus the stage's whole parameters
               gathered and its whole gradients accumulated while the step runs
"""

from __future__ import annotations

from typing import Any, Sequence

from zbcompile.inspect.text import format_stages, format_table, si

DATA_PARALLEL_MODES = ("replicate", "shard")


def state_bytes(param_bytes: float, dp: int, mode: str, grad_factor: float = 1.0, optimizer_factor: float = 2.0) -> dict[str, float]:
    """Bytes one rank holds for a stage's `param_bytes` of parameters during a step (see the
    module docstring): "params", "grads", "optimizer" and their "total"."""
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {mode!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    grads, optimizer = param_bytes * grad_factor, param_bytes * optimizer_factor
    if mode == "replicate":
        held = {"params": param_bytes, "grads": grads, "optimizer": optimizer}
    else:
        held = {"params": param_bytes + param_bytes / dp, "grads": grads + grads / dp, "optimizer": optimizer / dp}
    return {**held, "total": sum(held.values())}


def format_state_table(rows: Sequence[dict[str, Any]], dp: int, mode: str) -> str:
    """Per stage: parameters, and the bytes one rank holds for them (`state_bytes`: stored in
    `row["state"]`, or computed for `dp` and `mode`), then M_B, M_W and, where the rows have them,
    predicted F/I/W seconds."""
    timed = all("seconds" in row for row in rows)
    header = ["stage", "layers", "params", "param B", "grad B", "optim B", "state B", "M_B", "M_W"]
    header += ["F", "I", "W"] if timed else []
    lines = []
    for row in rows:
        state = row.get("state") or state_bytes(row["param_bytes"], dp, mode)
        line = [
            str(row["stage"]), row.get("layers", "-"), si(row["params"]),
            *(si(state[k], "B") for k in ("params", "grads", "optimizer", "total")),
            si(row["mem_b"], "B"), si(row["mem_w"], "B"),
        ]
        if timed:
            line += [_ms(row["seconds"][k]) for k in ("F", "I", "W")]
        lines.append(tuple(line))
    title = f"state per rank ({mode}, dp={dp}; AdamW moments in the parameters' dtype), activations per microbatch"
    return title + (", predicted pass times" if timed else "") + ":\n" + format_table(header, lines)


def _ms(seconds: float) -> str:
    """Seconds in the unit that reads best: s, ms or µs."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2f} µs"


def format_schedules(record: dict[str, Any]) -> str:
    """One line per schedule: peak memory per rank (state + activations, the largest rank's
    and the list), whether every rank fits, predicted step time (makespan), steady-state step
    (span) and the stage bubble; then zb-auto's choice."""
    limit = record["memory_limit_bytes"]
    header = ("schedule", "peak (max rank)", "fits", "step", "steady step", "bubble", "stage bubble", "peak per rank")
    lines = []
    for entry in record["schedules"]:
        if entry.get("error"):
            lines.append((entry["name"], "-", "no", "-", "-", "-", "-", entry["error"]))
            continue
        peaks = entry["peak_bytes"]
        lines.append((
            entry["name"], si(max(peaks), "B"), "yes" if entry["fits"] else "no", _ms(entry["makespan"]),
            _ms(entry["span"]), f"{entry['bubble_rate']:.1%}", f"{entry['stage_bubble_rate']:.1%}",
            " ".join(si(b, "B").replace(" ", "") for b in peaks),
        ))
    text = [
        f"schedules (memory per rank: state + activations with each action's own peak, against {si(limit, 'B')}):",
        format_table(header, lines),
        "step = makespan (a barrier ends every step); steady step = span (steps back to back, the paper's); "
        "stage bubble = 1 - busy / (ranks x span)",
    ]
    if record.get("allreduce_seconds"):
        text.append(
            f"plus the data-parallel gradient reduction after the step: {_ms(record['allreduce_seconds'])} "
            f"(ring over dp={record['dp']}, largest rank's gradients, not overlapped)"
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
        f"zb-auto would choose: {choice['description']} (steady step {_ms(choice['span'])}, "
        f"{choice['speedup_over_1f1b']:.3f}x 1F1B's steady-step throughput)"
        if choice.get("speedup_over_1f1b") else f"zb-auto would choose: {choice['description']}"
    )


def plan_text(record: dict[str, Any]) -> str:
    """The whole plan: what was planned on what hardware, compile times, the stage table
    (`format_stages`, as `pipe.explain()` prints it), state and times per stage, the schedules."""
    hw = record["hardware"]
    efficiency = hw["pass_efficiency"] or {"all": hw["efficiency"]}
    reused = [s for s, r in enumerate(record["representative"]) if r != s]
    lines = [
        f"plan: {record['model']}, {record['stages']} stages, {record['microbatches']} microbatches of "
        f"{record['microbatch']}, dp={record['dp']} ({record['data_parallel']})",
        f"hardware: {hw['name']}: {si(hw['flops'], 'FLOP/s')}, memory {si(hw['memory_bandwidth'], 'B/s')}, "
        f"link {si(hw['link_bandwidth'], 'B/s')}, {si(hw['memory'], 'B')}; efficiency "
        + ", ".join(f"{k} {v:.2f}" for k, v in efficiency.items()),
        "compile: " + ", ".join(f"{k} {v:.2f}s" for k, v in record["phase_seconds"].items())
        + (f"; stages {', '.join(map(str, reused))} reuse an identical stage's programs" if reused else ""),
        "",
        format_stages(record["stage_rows"], record["tied"]),
        "",
        format_state_table(record["stage_rows"], record["dp"], record["data_parallel"]),
        f"boundary message: {_ms(record['comm_seconds'])} (largest boundary over the link)",
        "",
        format_schedules(record),
    ]
    return "\n".join(lines)
