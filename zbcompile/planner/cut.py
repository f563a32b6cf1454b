"""The plan's cut where the compiler's (balanced by FLOPs) is not the question's answer: where
the memory limit binds (some rank's state and 1F1B's activations pass it) or the ranks are of
different kinds, the cut is chosen by the predicted step time under each rank's memory
(`schedules/cut_choice.choose_cut`, the decision the runtime makes with measured costs): each
position's F, I and W timed on the hardware of the rank that would run it, each rank's state
(parameters, gradients, optimizer state under the data-parallel mode) and activations within its
limit, with each stage's largest action's transient memory (what the M_B/M_W model leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from zbcompile.compiler import CostedPipeline
from zbcompile.passes.cut_profile import cut_layout, static_units
from zbcompile.planner.hardware import Hardware
from zbcompile.planner.pricing import replica_cut_settings
from zbcompile.schedules import make_schedule
from zbcompile.schedules.cut_choice import Cut, CutDecision, choose_cut

PLAN_THRESHOLD = 0.01  # the predicted gain a cut must bring over the compiler's


@dataclass(frozen=True)
class _Pass:
    flops: float
    written_bytes: float


def pass_timer(hardware: Hardware) -> Callable[[str, float, float], float]:
    """`passes/cut_profile.RankTime` on `hardware`: seconds of a pass of one kind from its FLOPs
    and bytes written."""
    return lambda kind, flops, written: hardware.pass_seconds(_Pass(flops, written), kind)


def binds(peaks: Sequence[float], limits: Sequence[float]) -> bool:
    """Whether some rank's peak (state + 1F1B's activations) passes its limit."""
    return any(p > limit for p, limit in zip(peaks, limits))


def one_f_one_b_peaks(plan_: Any) -> list[float]:
    """Per rank: state + 1F1B's activations with each action's own peak (`Plan.peak_bytes`)."""
    return plan_.peak_bytes(make_schedule("1f1b", len(plan_.state), plan_.options.microbatches, plan_.costs))


def cut_decision(
    costed: CostedPipeline, rank_hardware: Sequence[Hardware], limits: Sequence[float], options: Any,
) -> CutDecision:
    """The cut of `costed`'s model chosen by predicted step time on `rank_hardware` within
    `limits` (bytes per rank; `options`: the plan's `PlanOptions`), against the compile's own."""
    layout = cut_layout(costed.traced, costed.partition)
    timers: list[tuple[Hardware, Any]] = []  # ranks of one kind share one timing
    for hardware in rank_hardware:
        if not any(h == hardware for h, _ in timers):
            timers.append((hardware, pass_timer(hardware)))
    rank_time = [next(t for h, t in timers if h == hardware) for hardware in rank_hardware]
    units = static_units(layout, costed.programs, rank_time, costed.representative)
    settings = replica_cut_settings(
        options.microbatches, options.dp, options.data_parallel, options.grad_factor, options.optimizer_factor,
        max(1.0 / h.link_bandwidth for h in rank_hardware),
        max(h.allreduce_seconds(1.0, options.dp) for h in rank_hardware), limits, options.time_budget,
    )
    return choose_cut(units, Cut("in-line", tuple(costed.partition.cuts)), settings, PLAN_THRESHOLD)


def decision_record(decision: CutDecision, reason: str) -> dict[str, Any]:
    """What the plan's report says of the cut: the compiler's, the chosen one, why."""
    return {
        "compiled": list(decision.current.cut.positions),
        "chosen": list(decision.chosen.cut.positions),
        "predicted_gain": decision.gain,
        "why": reason,
        "reason": decision.reason,
    }
