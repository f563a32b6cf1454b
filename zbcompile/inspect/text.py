"""What the compiler did, as text: the per-stage table (parameters, F/I/W FLOPs, activation
memory M_B and M_W, boundary bytes), the schedule's costs and predicted makespan and bubble
against the measured ones (`summary_text`, what `zbcompile inspect` and `pipe.explain()` print).

`stage_rows` turns a compiled pipeline into plain per-stage facts (JSON-able: the dump stores
them); `format_stage_table` prints them, so the table reads the same live and from a dump. Pure Python; no torch."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from zbcompile.inspect.decisions_text import cut_lines
from zbcompile.inspect.read import Dump
from zbcompile.inspect.timelines import MOVED, median, median_step, steady_steps, step_stats
from zbcompile.inspect.units import seconds_text, si
from zbcompile.schedules.memory_limit import state_bytes

if TYPE_CHECKING:
    from zbcompile.compiler import CompiledPipeline

PASSES = ("F", "I", "W")  # the schedule's letters: forward, input-gradient, weight-gradient
_NO_TRACE = "none (per-action times are recorded in distributed runs with pipeline(dump_dir=...) or ZBCOMPILE_DUMP)"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width columns, right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows])


def _value(name: str, info: Any) -> dict[str, Any]:
    if info is None:
        return {"name": name, "shape": None, "dtype": None, "bytes": None}
    return {
        "name": name,
        "shape": list(info.shape),
        "dtype": str(info.dtype).removeprefix("torch."),
        "bytes": info.nbytes,
    }


def stage_rows(compiled: "CompiledPipeline") -> list[dict[str, Any]]:
    """Per stage: the parameters it owns (a tied weight counts on its first stage) and their bytes
    on one rank (a tensor-parallel parameter's local shard),
    FLOPs, written bytes and estimated time (FLOP-equivalents) of F, I and W, M_B and M_W in
    bytes, the boundary values it receives and sends (name, shape, dtype, bytes), and the bytes
    crossing the boundary to the next stage."""
    return stage_rows_of(_held_parameters(compiled), compiled.partition, [p.cost for p in compiled.programs])


def _held_parameters(compiled: "CompiledPipeline") -> list[tuple[str, Any]]:
    """(FQN, the parameter as one rank computes with it: a tensor-parallel shard's local shape,
    as the stages were traced) for every parameter of the compile."""
    traced = compiled.traced
    return [(fqn, traced.fake_state[fqn]) for fqn in traced.param_fqns]


def stage_rows_of(
    named_parameters: Any, partition: Any, costs: Sequence[Any], shares: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """`stage_rows` from the model's `named_parameters()`, a `StagePartition` and each stage's
    `StageGraphCost` (what a plan has without stage programs); `shares`: the share of a parameter
    one tensor-parallel rank holds, by FQN (1 where absent)."""
    params = dict(named_parameters)
    share = shares or {}

    def count(fqn: str) -> int:
        return int(params[fqn].numel() * share.get(fqn, 1.0))

    def nbytes(fqn: str) -> int:
        return count(fqn) * params[fqn].element_size()

    rows = []
    for cost, stage in zip(costs, partition.stages):
        graphs = dict(zip(PASSES, (cost.forward, cost.input_backward, cost.weight_backward)))
        owned = [f for f in stage.param_fqns if partition.shared_params.get(f, (stage.index,))[0] == stage.index]
        rows.append(
            {
                "stage": stage.index,
                "params": sum(count(f) for f in owned),
                "param_bytes": sum(nbytes(f) for f in owned),
                # what the stage's rank holds: a weight shared with another stage too (a tied embedding)
                "held_param_bytes": sum(nbytes(f) for f in stage.param_fqns),
                "param_fqns": list(stage.param_fqns),
                "layers": layers_of(stage.param_fqns),
                "flops": {k: g.flops for k, g in graphs.items()},
                "written_bytes": {k: g.written_bytes for k, g in graphs.items()},
                "time_estimate": {k: g.time_estimate for k, g in graphs.items()},
                "mem_b": cost.mem_b,
                "mem_w": cost.mem_w,
                "inputs": [_value(n, partition.values.get(n)) for n in stage.inputs],
                "outputs": [_value(n, partition.values.get(n)) for n in stage.outputs],
                "send_bytes": partition.boundary_bytes[stage.index]
                if stage.index < len(partition.boundary_bytes)
                else 0,
            }
        )
    return rows


_BLOCK_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


def layers_of(param_fqns: Sequence[str]) -> str:
    """The modules a stage's parameters belong to, numbered blocks as ranges:
    `model.embed_tokens, model.layers.0-9`."""
    ranges: dict[str, list[int]] = {}
    for fqn in param_fqns:
        match = _BLOCK_INDEX.match(fqn)
        if match:
            ranges.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            ranges.setdefault(fqn.rpartition(".")[0] or fqn, [])
    parts = []
    for owner, indices in ranges.items():
        if not indices:
            parts.append(owner)
            continue
        low, high = min(indices), max(indices)
        parts.append(f"{owner}.{low}" if low == high else f"{owner}.{low}-{high}")
    return ", ".join(parts)


def format_stage_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table of `stage_rows`: one line per stage."""
    header = ("stage", "params", "param bytes", "F flops", "I flops", "W flops", "W share", "M_B", "M_W", "sends")
    lines = []
    for row in rows:
        flops = row["flops"]
        backward = flops["I"] + flops["W"]
        lines.append((
            str(row["stage"]), si(row["params"]), si(row["param_bytes"], "B"), si(flops["F"]), si(flops["I"]),
            si(flops["W"]), f"{flops['W'] / backward:.0%}" if backward else "-", si(row["mem_b"], "B"),
            si(row["mem_w"], "B"), si(row["send_bytes"], "B"),
        ))
    return format_table(header, lines)


def format_boundaries(rows: Sequence[dict[str, Any]]) -> str:
    """One line per boundary: the values stage s sends to stage s+1, with shapes and bytes."""
    lines = []
    for row in rows[:-1]:
        values = ", ".join(
            f"{v['name']} {v['dtype']}{v['shape']} ({si(v['bytes'], 'B')})" if v["shape"] is not None else v["name"]
            for v in row["outputs"]
        )
        lines.append(f"  {row['stage']} -> {row['stage'] + 1}: {values or '(nothing)'}")
    return "\n".join(lines)


def format_tied(shared: dict[str, Sequence[int]]) -> str:
    tied = ", ".join(f"{fqn} (stages {', '.join(map(str, ks))})" for fqn, ks in shared.items())
    return f"tied weights: {tied}; gradients summed over the stages that use them" if tied else ""


def format_stages(rows: Sequence[dict[str, Any]], shared: dict[str, Sequence[int]]) -> str:
    """The stage table, the boundary values and the tied weights."""
    tied = format_tied(shared)
    lines = [format_stage_table(rows), "boundaries (values sent to the next stage):", format_boundaries(rows)]
    return "\n".join(lines + ([tied] if tied else []))


def state_rows(
    compiled: "CompiledPipeline", stages_on: Sequence[Sequence[int]], replicas: int, mode: str, grad_dtype: Any = None
) -> list[dict[str, int]]:
    """Per pipeline rank (holding stages `stages_on[rank]`): the bytes of parameters, gradients (in
    `grad_dtype` where given, else the parameter's) and Adam(W)'s two moments it holds outside a
    step under data-parallel `mode` ("replicate", or "shard" over `replicas`: a replica's rows
    padded as `runtime.sharding.Rows` pads them, the most any replica holds), a tied weight
    counted on every rank that holds it."""
    params = dict(_held_parameters(compiled))
    rows = []
    for rank, stages in enumerate(stages_on):
        held = grads = 0
        for fqn in {f for s in stages for f in compiled.partition.stages[s].param_fqns}:
            p = params[fqn]
            numel = p.numel()
            if mode == "shard" and p.dim() > 0:
                numel = math.ceil(p.shape[0] / replicas) * math.prod(p.shape[1:])
            held += numel * p.element_size()
            grads += numel * (
                grad_dtype.itemsize if grad_dtype is not None and p.is_floating_point() else p.element_size()
            )
        rows.append({"rank": rank, "params": held, "grads": grads, "optimizer": 2 * held})
    return rows


def format_state_memory(rows: Sequence[dict[str, int]], mode: str, replicas: int) -> str:
    """Per pipeline rank, the bytes of parameters, gradients and optimizer state it holds outside a
    step (`state_rows`), under data-parallel `mode` over `replicas`."""
    how = f"data_parallel={mode!r} over {replicas} replica{'s' if replicas > 1 else ''}"
    lines = [f"state per rank outside a step ({how}; optimizer state as Adam(W)'s two moments):"]
    for row in rows:
        total = row["params"] + row["grads"] + row["optimizer"]
        lines.append(
            f"  rank {row['rank']}: parameters {si(row['params'], 'B')}, gradients {si(row['grads'], 'B')}, "
            f"optimizer {si(row['optimizer'], 'B')}, total {si(total, 'B')}"
        )
    return "\n".join(lines)


def format_phases(seconds: dict[str, float]) -> str:
    return "compile: " + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())


def format_state_table(rows: Sequence[dict[str, Any]], dp: int, mode: str) -> str:
    """Per stage: parameters, and the bytes one rank holds for them (`state_bytes`: stored in
    `row["state"]`, or computed for `dp` and `mode`), then M_B, M_W and, where the rows have them,
    predicted F/I/W seconds."""
    timed = all("seconds" in row for row in rows)
    header = ["stage", "layers", "params", "param B", "grad B", "optim B", "state B", "M_B", "M_W"]
    header += ["F", "I", "W"] if timed else []
    lines = []
    for row in rows:
        state = row.get("state") or state_bytes(row.get("held_param_bytes", row["param_bytes"]), dp, mode)
        line = [
            str(row["stage"]), row.get("layers", "-"), si(row["params"]),
            *(si(state[k], "B") for k in ("params", "grads", "optimizer", "total")),
            si(row["mem_b"], "B"), si(row["mem_w"], "B"),
        ]
        if timed:
            line += [seconds_text(row["seconds"][k]) for k in ("F", "I", "W")]
        lines.append(tuple(line))
    title = f"state per rank ({mode}, dp={dp}; AdamW moments in the parameters' dtype), activations per microbatch"
    return title + (", predicted pass times" if timed else "") + ":\n" + format_table(header, lines)


# --- the schedule, predicted and measured ----------------------------------------------------


def _time(value: float, unit: str) -> str:
    return f"{value * 1e3:.2f} ms" if unit == "s" else si(value)


def _rates(bubble: float, stage_bubble: float) -> str:
    return f"bubble {bubble:.1%} (stage bubble {stage_bubble:.1%})"


def format_schedule(version: dict[str, Any], count: int = 1, memory_unit: int | None = None) -> str:
    """The schedule's costs and the simulator's prediction under them."""
    unit, costs, predicted = version["time_unit"], version["costs"], version["prediction"]
    ranks = len(version["actions"])
    placement = ", ".join(f"{s}->{r}" for s, r in enumerate(version["stage_to_rank"]))
    if version.get("mirrored_from") is not None:  # dualpipe's second copy
        mirrored = ", ".join(f"{s}->{ranks - 1 - r}" for s, r in enumerate(version["stage_to_rank"]))
        placement += f"; from microbatch {version['mirrored_from']} on {mirrored}"
    source = {
        "measured": "measured on this machine (seconds)",
        "given": "given to pipeline(costs=...)",
    }.get(version["cost_source"], "static estimates in FLOP-equivalents (FLOPs + 4 x bytes written)")
    lines = [
        f"schedule {version['name']} (version {version['version']} of {count}), {ranks} ranks (stage->rank "
        f"{placement}), {version['microbatches']} microbatches"
    ]
    info = version.get("info", {})
    if info.get("placement") == "v":
        lines.append(
            f"placement: V, two chunks per rank ({info.get('v_source')} order), chosen as the faster placement by "
            "zb-auto's objective under the memory limit (or by the cut chosen by measurement)"
        )
    lines.append(f"costs: {source}, comm {_time(costs['comm'], unit)}")

    def memory(units: float) -> str:
        return si(units * memory_unit, "B") if memory_unit else f"{units:.2f}"

    rows = [
        (str(s), *(_time(costs[k][s], unit) for k in "fiw"), memory(costs["mem_b"][s]), memory(costs["mem_w"][s]))
        for s in range(version["stages"])
    ]
    lines.append(format_table(("stage", "F", "I", "W", "M_B", "M_W"), rows))
    if any(costs.get("reduce", ())):
        shown = ", ".join(f"{s} {_time(t, unit)}" for s, t in enumerate(costs["reduce"]))
        lines.append(
            "gradient reduction over the replicas after each stage's last W (on the link, counted in the prediction): "
            f"{shown}"
        )
    if version.get("memory_limit"):
        shown = ", ".join(memory(v) for v in version["memory_limit"])
        rule = version.get("info", {}).get("memory_limit_rule", "the schedule's own")
        lines.append(f"memory limit per rank: {shown} ({rule})")
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
    stats = [s for s in step_stats(trace) if s["schedule_version"] == version["version"]]
    steps = steady_steps(stats)
    if not steps:
        return None
    predicted = version["prediction"]
    busy = median(s["busy"] for s in steps)
    scale = 1.0 if version["time_unit"] == "s" else busy / max(sum(predicted["busy"]), 1e-30)
    makespan = median(s["makespan"] for s in steps)
    ranks = sorted(steps[0]["rank_busy"])
    return {
        "steps": [s["step"] for s in steps],
        "makespan": makespan,
        "span": median(s["span"] for s in steps),
        "bubble_rate": median(s["bubble_rate"] for s in steps),
        "stage_bubble_rate": median(s["stage_bubble_rate"] for s in steps),
        "rank_busy": [median(s["rank_busy"][r] for s in steps) for r in ranks],
        "recv_wait": [median(s["recv_wait"][r] for s in steps) for r in ranks],
        "moved": {how: median(s.get("moved", {}).get(how, 0) for s in steps) for how in MOVED.values()},
        "scale": scale,
        "predicted_makespan": predicted["makespan"] * scale,
        "ratio": makespan / (predicted["makespan"] * scale) if predicted["makespan"] > 0 else float("nan"),
        "representative": median_step(steps)["step"],
        "peak_live_bytes": [
            info["peak_live_bytes"]
            for _, info in sorted(trace["otherData"]["ranks"].items(), key=lambda kv: int(kv[0]))
        ],
    }


def format_measured(version: dict[str, Any], trace: dict[str, Any] | None) -> str:
    found = comparison(version, trace)
    if found is None:
        return f"measured: {_NO_TRACE}"
    steps = found["steps"]
    how = (
        "the schedule's measured costs, in seconds"
        if version["time_unit"] == "s"
        else "static estimates put in seconds so that predicted busy time equals measured: "
        f"{found['scale'] * 1e9:.3g} ns per FLOP-eq"
    )
    return "\n".join(
        [
            f"measured: {len(steps)} steps of version {version['version']} (steps {steps[0]}-{steps[-1]}; a schedule's "
            "first step warms up and is left out), medians:",
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


def _replicas(world: dict[str, Any]) -> int:
    """Data-parallel replicas of the pipeline (1 in one process)."""
    return max(1, world["world_size"] // world["ranks_per_pipeline"]) if world["distributed"] else 1


def summary_text(dump: Dump) -> str:
    """Stages, balance, costs, predicted against measured makespan and bubble."""
    record = dump.record
    world = record["world"]
    version = dump.versions[-1]
    where = f"{world['world_size']} processes" if world["distributed"] else "one process"
    lines = [
        f"{record['model']}: {record['stages']} stages, {record['microbatches']} microbatches, "
        f"schedule {version['name']} on {len(version['actions'])} ranks ({where})",
        format_phases(record["phase_seconds"]),
        *([f"symbolic sizes: {record['symbolic']}"] if record.get("symbolic") else []),
        "",
        format_stages(record["stage_rows"], record["tied"]),
        *record.get("recompute", []),
        *cut_lines(record.get("cut")),
        _balance(version),
        "",
        format_state_table(record["stage_rows"], _replicas(world), "replicate"),
        "",
        format_schedule(version, len(dump.versions), record["memory_unit"]),
        format_measured(version, dump.trace),
        "bubble = 1 - busy / (ranks x makespan); stage bubble = 1 - busy / (ranks x span), the paper's",
    ]
    if "state_bytes" in world:  # dumps from before data-parallel modes have none
        lines.append(format_state_memory(world["state_bytes"], world["data_parallel"], world["replicas"]))
    return "\n".join(lines)


# --- the I/W split ----------------------------------------------------------------------------
