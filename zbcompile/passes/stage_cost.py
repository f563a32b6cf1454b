"""A stage's cost model: FLOPs and bytes of its F, I and W programs, M_B (what F keeps for the
backward), M_W (what W still needs after I), each action's own peak, and the schedule
simulator's peak memory with those peaks in place of the M_B/M_W model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from zbcompile.passes import _fx
from zbcompile.passes.graph_cost import GraphCost, graph_cost, peak_bytes
from zbcompile.passes.joint import StageJoint
from zbcompile.passes.partition import Stage, StagePartition
from zbcompile.passes.program import Program
from zbcompile.passes.split_backward import StageIWPrograms, held_until_weight
from zbcompile.schedules import Costs, Schedule
from zbcompile.schedules.costs import ResolvedCosts, resolve_costs
from zbcompile.schedules.simulate import peak_memory
from zbcompile.value_names import INPUT, SAVED, TANGENT, UPDATE


@dataclass(frozen=True)
class StageGraphCost:
    """Static cost of one stage for one microbatch: FLOPs/bytes of F, I and W; `mem_b` bytes F
    keeps for the backward (M_B), `mem_w` bytes W still needs once I has run (M_W);
    `action_peaks`: by action ("F", "I", "W", "B"), the most bytes alive while it runs
    (`graph_cost.peak_bytes`: what it took in, what it creates), the transients the schedule's
    memory model (M_B, M_W) leaves out."""

    forward: GraphCost
    input_backward: GraphCost
    weight_backward: GraphCost
    mem_b: int
    mem_w: int
    action_peaks: Mapping[str, int] = field(default_factory=dict)


def forward_peak(program: Program, stage: Stage, partition: StagePartition) -> int:
    """The most bytes alive while a forward-only stage program runs: what it reads, freed at its
    last use except what it relays and the batch's tensors (the caller holds the batch), plus
    the relayed values it does not read, held throughout."""
    inputs = set(program.signature.inputs)
    kept = {
        n
        for n in inputs
        if n.removeprefix(INPUT) in stage.relays or n.startswith((f"{INPUT}input_", f"{INPUT}target_"))
    }
    passing = sum(partition.values[v].nbytes for v in stage.relays if f"{INPUT}{v}" not in inputs)
    return peak_bytes(program, kept, passing)



def kept_bytes_formula(joint: StageJoint) -> Any:
    """M_B's bytes as a sympy expression of symbolic sizes: what the backward reads of what F
    kept, each value counted whole (views of one storage each: a formula's ratio is what is read)."""
    names = dict(zip(joint.backward.graph.graph.find_nodes(op="placeholder"), joint.backward.signature.inputs))
    kept = [node for node, name in names.items() if name.startswith((SAVED, INPUT, UPDATE))]
    return sum((_fx.symbolic_bytes(node.meta.get("val")) for node in kept), 0)


def stage_cost(joint: StageJoint, split: StageIWPrograms) -> StageGraphCost:
    saved = [n for n in joint.backward.signature.inputs if n.startswith((SAVED, INPUT, UPDATE))]
    # what each action keeps of what it took in: the runtime keeps F's inputs and the output
    # gradients (their sender holds them), I what W reads (F's values only W reads pass I by)
    tangents = {n for n in joint.backward.signature.inputs if n.startswith(TANGENT)}
    passing_i = joint.held_bytes([n for n in split.weight_reads if n not in split.input_backward.signature.inputs])
    return StageGraphCost(
        forward=graph_cost(joint.forward.graph),
        input_backward=graph_cost(split.input_backward.graph),
        weight_backward=graph_cost(split.weight_backward.graph),
        mem_b=joint.held_bytes(saved),
        mem_w=held_until_weight(joint, split),
        action_peaks={
            "F": peak_bytes(joint.forward, set(joint.forward.signature.inputs)),
            "I": peak_bytes(split.input_backward, tangents | set(split.weight_reads), passing_i),
            "W": peak_bytes(split.weight_backward, ()),
            "B": peak_bytes(joint.backward, tangents),
        },
    )


def peak_memory_with_transients(
    schedule: Schedule, costs: Costs, stage_costs: Sequence[StageGraphCost], unit_bytes: float
) -> tuple[float, ...]:
    """Per rank, the simulator's peak activation memory of `schedule` under `costs` (memory in
    units of `unit_bytes`) with each action's own peak (`StageGraphCost.action_peaks`) in place of
    its memory model's."""
    resolved = resolve_costs(costs, schedule.stages)
    peaks = tuple({kind: bytes_ / unit_bytes for kind, bytes_ in c.action_peaks.items()} for c in stage_costs)
    return peak_memory(schedule, _WithActionPeaks(**vars(resolved), action_peaks=peaks))


@dataclass(frozen=True)
class _WithActionPeaks(ResolvedCosts):
    """Costs whose actions rise to their own peaks (per stage: by kind, in memory units), the
    microbatch's own saved values before them included."""

    action_peaks: tuple[Mapping[str, float], ...] = ()

    def memory_rise(self, stage: int, kind: str) -> float:
        peak = self.action_peaks[stage].get(kind)
        if peak is None:  # communication
            return super().memory_rise(stage, kind)
        own_before = {"I": self.mem_b, "B": self.mem_b, "W": self.mem_w}.get(kind)
        return max(self.memory_delta(stage, kind), peak - (own_before[stage] if own_before else 0.0))
