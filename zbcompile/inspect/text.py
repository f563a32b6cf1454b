"""Text summaries of what the compiler did: one row per stage with parameters, F/I/W FLOPs,
activation memory (M_B, M_W) and boundary bytes.

`stage_rows` turns a compiled pipeline into plain per-stage facts (JSON-able: the dump stores
them); `format_stage_table` prints them. Both `stage_table` and `zbcompile inspect` print
through it, so the table reads the same live and from a dump."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from zbcompile.compiler import CompiledPipeline

PASSES = ("F", "I", "W")  # the schedule's letters: forward, input-gradient, weight-gradient


def si(value: float, unit: str = "") -> str:
    """`1234567` -> `1.23 M`; units after the prefix (`si(2048, "B")` -> `2.05 kB`)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()



def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width columns, right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows])


def _value(name: str, info: Any) -> dict[str, Any]:
    if info is None:
        return {"name": name, "shape": None, "dtype": None, "bytes": None}
    return {"name": name, "shape": list(info.shape), "dtype": str(info.dtype).removeprefix("torch."), "bytes": info.nbytes}


def stage_rows(compiled: "CompiledPipeline") -> list[dict[str, Any]]:
    """Per stage: the parameters it owns (a tied weight counts on its first stage) and their bytes,
    FLOPs, written bytes and estimated time (FLOP-equivalents) of F, I and W, M_B and M_W in
    bytes, the boundary values it receives and sends (name, shape, dtype, bytes), and the bytes
    crossing the boundary to the next stage."""
    params = dict(compiled.traced.model.named_parameters())
    partition = compiled.partition
    rows = []
    for program, stage in zip(compiled.programs, partition.stages):
        cost = program.cost
        graphs = dict(zip(PASSES, (cost.forward, cost.input_backward, cost.weight_backward)))
        owned = [f for f in stage.param_fqns if partition.shared_params.get(f, (stage.index,))[0] == stage.index]
        rows.append(
            {
                "stage": stage.index,
                "params": sum(params[f].numel() for f in owned),
                "param_bytes": sum(params[f].numel() * params[f].element_size() for f in owned),
                "param_fqns": list(stage.param_fqns),
                "flops": {k: g.flops for k, g in graphs.items()},
                "written_bytes": {k: g.written_bytes for k, g in graphs.items()},
                "time_estimate": {k: g.time_estimate for k, g in graphs.items()},
                "mem_b": cost.mem_b,
                "mem_w": cost.mem_w,
                "inputs": [_value(n, partition.values.get(n)) for n in stage.inputs],
                "outputs": [_value(n, partition.values.get(n)) for n in stage.outputs],
                "send_bytes": partition.boundary_bytes[stage.index] if stage.index < len(partition.boundary_bytes) else 0,
            }
        )
    return rows


def format_stage_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table of `stage_rows`: one line per stage."""
    header = ("stage", "params", "param bytes", "F flops", "I flops", "W flops", "W share", "M_B", "M_W", "sends")
    lines = []
    for row in rows:
        flops = row["flops"]
        backward = flops["I"] + flops["W"]
        lines.append(
            (
                str(row["stage"]),
                si(row["params"]),
                si(row["param_bytes"], "B"),
                si(flops["F"]),
                si(flops["I"]),
                si(flops["W"]),
                f"{flops['W'] / backward:.0%}" if backward else "-",
                si(row["mem_b"], "B"),
                si(row["mem_w"], "B"),
                si(row["send_bytes"], "B"),
            )
        )
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


def format_phases(seconds: dict[str, float]) -> str:
    return "compile: " + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())


def stage_table(compiled: "CompiledPipeline") -> str:
    """The stage table, boundary values, tied weights and compile times of `compiled`."""
    stages = format_stages(stage_rows(compiled), compiled.partition.shared_params)
    return stages + "\n" + format_phases(compiled.phase_seconds)
