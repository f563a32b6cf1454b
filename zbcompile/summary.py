"""Text summaries of what the compiler did: one row per stage with parameters, F/B/W FLOPs,
activation memory (M_B, M_W) and boundary bytes."""

from __future__ import annotations

from zbcompile.compiler import CompiledPipeline


def _si(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def stage_table(compiled: CompiledPipeline) -> str:
    """A fixed-width table, one row per stage."""
    model = compiled.traced.model
    params = dict(model.named_parameters())
    header = ("stage", "params", "F flops", "B flops", "W flops", "W share", "M_B", "M_W", "sends")
    rows = []
    for program, stage in zip(compiled.programs, compiled.partition.stages):
        cost = program.cost
        owned = [f for f in stage.param_fqns if compiled.partition.shared_params.get(f, (stage.index,))[0] == stage.index]
        backward = cost.input_backward.flops + cost.weight_backward.flops
        sends = compiled.partition.boundary_bytes[stage.index] if stage.index < len(compiled.partition.boundary_bytes) else 0
        rows.append(
            (
                str(stage.index),
                _si(sum(params[f].numel() for f in owned)),
                _si(cost.forward.flops),
                _si(cost.input_backward.flops),
                _si(cost.weight_backward.flops),
                f"{cost.weight_backward.flops / backward:.0%}" if backward else "-",
                _si(cost.mem_b, "B"),
                _si(cost.mem_w, "B"),
                _si(sends, "B"),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    tied = ", ".join(f"{fqn} (stages {', '.join(map(str, ks))})" for fqn, ks in compiled.partition.shared_params.items())
    if tied:
        lines.append(f"tied weights: {tied}; gradients summed over the stages that use them")
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in compiled.phase_seconds.items())
    lines.append(f"compile: {phases}")
    return "\n".join(lines)
