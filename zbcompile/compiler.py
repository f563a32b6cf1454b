"""Runs the passes in order; the only place that knows the order.

    training:        trace_model -> partition_stages -> export_stage_joints -> split_backward -> costs
    forward only:    trace_model -> held_cuts -> partition_stages -> forward_program -> peak bytes
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile import _torch_internals as ti
from zbcompile.passes.forward_only import forward_program
from zbcompile.passes.graph_cost import cost_formula
from zbcompile.passes.held_cuts import held_cuts
from zbcompile.passes.joint import StageJoint, export_stage_joint, export_stage_joints
from zbcompile.passes.partition import Stage, StagePartition, partition_stages
from zbcompile.passes.program import Program
from zbcompile.passes.recompute import RECOMPUTE_LEVELS
from zbcompile.passes.split_backward import MIN_DEFERRAL_INTENSITY, StageIWPrograms, split_backward
from zbcompile.passes.stage_cost import (
    StageGraphCost,
    forward_peak,
    kept_bytes_formula,
    peak_memory_with_transients,
    stage_cost,
)
from zbcompile.passes.stage_reuse import renamed_joint, renamed_split, stage_fingerprint, stage_name_map
from zbcompile.passes.trace import TracedModel, trace_model
from zbcompile.schedules import Costs, Schedule


@dataclass(frozen=True)
class StageProgram:
    """Everything the runtime needs to run one stage: its place in the pipeline (`stage`), the
    forward F, the input-gradient graph I, the weight-gradient graph W and their costs."""

    stage: Stage
    joint: StageJoint
    split: StageIWPrograms
    cost: StageGraphCost

    @property
    def index(self) -> int:
        return self.stage.index

    @property
    def forward(self) -> Program:
        return self.joint.forward

    @property
    def input_backward(self) -> Program:
        return self.split.input_backward

    @property
    def weight_backward(self) -> Program:
        return self.split.weight_backward


@dataclass(frozen=True)
class CompiledPipeline:
    """The compiler's result: the traced model, its partition, one StageProgram per stage, and
    the seconds each phase took."""

    traced: TracedModel
    partition: StagePartition
    programs: tuple[StageProgram, ...]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # recompute="auto": per stage, its program at level 0 and at each of `RECOMPUTE_LEVELS`;
    # the level each stage runs (0: checkpoint regions only); the bytes of one memory unit
    # (the largest stage's M_B without recomputation), so that limits keep their meaning
    alternatives: tuple[tuple[StageProgram, ...], ...] = ()
    recompute_levels: tuple[int, ...] = ()
    memory_unit_bytes: int | None = None
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)  # this process's CPU time, by phase
    # the cut chosen by measurement (`runtime/tuning/recut.py`): the cut measured, the one chosen, why
    cut_record: dict[str, Any] | None = None

    def schedule_costs(self) -> Costs:
        """Per-stage schedule costs from the static estimates: times in FLOP-equivalents; memory
        M_B (kept by F) and M_W (still needed by W after I; may exceed M_B, I then adds memory) in
        units of the largest stage's M_B (`memory_unit()` bytes), so that `memory_limit=8` means
        eight microbatches' activations of the largest stage."""
        costs = [p.cost for p in self.programs]
        unit = self.memory_unit()
        return Costs(
            f=[c.forward.time_estimate for c in costs],
            i=[c.input_backward.time_estimate for c in costs],
            w=[c.weight_backward.time_estimate for c in costs],
            mem_b=[c.mem_b / unit for c in costs],
            mem_w=[c.mem_w / unit for c in costs],
        )

    @functools.cached_property
    def cost_formulas(self) -> tuple[dict[str, Any], ...]:
        """Per stage, the static time estimate of each action (F, I, W, B) as a sympy expression
        of a shape-generic compile's symbols (`graph_cost.cost_formula`)."""
        formulas = []
        for program in self.programs:
            parts = (program.forward, program.input_backward, program.weight_backward)
            f, i, w = (cost_formula(part.graph) for part in parts)
            formulas.append({"F": f, "I": i, "W": w, "B": i + w, "M": kept_bytes_formula(program.joint)})
        return tuple(formulas)

    def memory_scale(self, values: Mapping[Any, int]) -> float:
        """How much more activation memory a microbatch at symbol `values` keeps than one at the
        example traced (the most of any stage's M_B; 1.0 for a compile of one shape)."""
        symbols = self.traced.symbols
        if symbols is None or not values:
            return 1.0
        return max(symbols.scale(f["M"], values) for f in self.cost_formulas)

    def work_scales(self, values: Mapping[Any, int]) -> dict[tuple[int, str], float]:
        """Per (stage, action kind), its static time estimate at symbol `values` over its estimate
        at the example traced: how much more work a microbatch of these sizes is (empty for a
        compile of one shape)."""
        symbols = self.traced.symbols
        if symbols is None or not values:
            return {}
        return {
            (stage, kind): symbols.scale(formula, values)
            for stage, formulas in enumerate(self.cost_formulas) for kind, formula in formulas.items()
        }

    def step_scale(self, values: Mapping[Any, int]) -> float:
        """A step's static time estimate (every stage's F, I and W) at symbol `values` over its
        estimate at the example traced (1.0 for a compile of one shape)."""
        symbols = self.traced.symbols
        if symbols is None or not values:
            return 1.0
        return symbols.scale(self._step_formula, values)

    @functools.cached_property
    def _step_formula(self) -> Any:
        """Every stage's F, I and W estimates summed (`cost_formulas`), built once."""
        return sum(f["F"] + f["B"] for f in self.cost_formulas)

    def checkpointed(self) -> bool:
        """Whether the model has `torch.utils.checkpoint` regions: some stage recomputes forward
        values of its own (recompute="auto"'s choices aside)."""
        own = [options[0] for options in self.alternatives] or self.programs
        return any(p.joint.recomputed for p in own)

    def memory_unit(self) -> int:
        """Bytes of one unit of `schedule_costs()`' memory: the largest stage's M_B (without
        compiler-chosen recomputation: `memory_unit_bytes` keeps it)."""
        return self.memory_unit_bytes or max([p.cost.mem_b for p in self.programs] + [1])

    def peak_memory_with_transients(self, schedule: Schedule, costs: Costs | None = None) -> tuple[float, ...]:
        """Per rank, the simulator's peak activation memory of `schedule` (in `costs`' memory unit,
        by default the static costs') with each action's own peak (`action_peaks`) in place of
        its memory model's: what the runtime measures with `measure_transients`."""
        costs = costs if costs is not None else self.schedule_costs()
        return peak_memory_with_transients(schedule, costs, [p.cost for p in self.programs], self.memory_unit())

    def recompute_choice(self) -> list[str]:
        """recompute="auto": one line per stage, its level, M_B and M_W against level 0 (checkpoint
        regions only) and the backward's added cost; empty without it."""
        lines = []
        for stage, level in enumerate(self.recompute_levels):
            base, chosen = self.alternatives[stage][0].cost, self.programs[stage].cost
            added = sum(g.time_estimate for g in (chosen.input_backward, chosen.weight_backward)) - sum(
                g.time_estimate for g in (base.input_backward, base.weight_backward)
            )
            name = RECOMPUTE_LEVELS[level - 1].name if level else "none"
            lines.append(
                f"stage {stage}: recompute {name} ({len(self.programs[stage].joint.recomputed)} nodes): "
                f"M_B {base.mem_b:,} -> {chosen.mem_b:,} bytes, M_W {base.mem_w:,} -> {chosen.mem_w:,} bytes, "
                f"backward +{added:,.0f} FLOP-eq"
            )
        return lines


class _Phases:
    """The wall-clock seconds and this process's CPU seconds of each timed phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    def timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        started, cpu = time.perf_counter(), time.process_time()
        result = fn()
        self.seconds[phase], self.cpu_seconds[phase] = time.perf_counter() - started, time.process_time() - cpu
        return result


def compile_pipeline(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, args: tuple, kwargs: dict[str, Any], target: Any,
    stages: int, split_points: Sequence[str] | None = None, device: torch.device | None = None,
    min_deferral_intensity: float = MIN_DEFERRAL_INTENSITY, cuts: Sequence[int] | None = None,
    recompute_alternatives: bool = False, reuse_stages: bool = False, reuse_blocks: bool = True,
    dynamic: Mapping[str, Sequence[int]] | None = None, stage_params: Sequence[frozenset[str]] | None = None,
) -> CompiledPipeline:
    """Compile one microbatch's forward + loss (`args`, `kwargs`, `target` are a microbatch).
    The model's parameters may be on the `meta` device; they compile as if on `device`.
    `min_deferral_intensity`: see `split_backward` (0 defers every weight gradient to W);
    `cuts`: reuse an earlier partition's cut positions (`StagePartition.cuts`);
    `recompute_alternatives`: also compile every stage at each level of `RECOMPUTE_LEVELS`
    (`CompiledPipeline.alternatives`, for recompute="auto"); `reuse_stages`: stages with equal
    `stage_fingerprint`s share one joint export, split and cost, each under its own names
    (`phase_seconds` then times "joint+split+cost" together); `reuse_blocks`: a stage's joint
    graph is assembled from its blocks' joints, each distinct block traced once for all stages, where that
    gives the same graph op for op (`passes/block_joint.py`), and traced whole otherwise. `dynamic`:
    the dimensions of each input leaf traced as symbols (`trace_model`; `passes/shape_symbols.py`);
    `stage_params`: see `partition_stages`."""
    phases = _Phases()
    # the errors we raise say what went wrong; ZBCOMPILE_DEBUG=1 shows torch's own log
    with ti.quiet_torch_logs():
        traced = phases.timed(
            "trace", lambda: trace_model(model, loss_fn, args, kwargs, target, device, dynamic=dynamic)
        )
    with ti.quiet_torch_logs(warnings_too=True):  # no user code runs in these passes
        partition = phases.timed(
            "partition", lambda: partition_stages(traced, stages, split_points, cuts=cuts, stage_params=stage_params)
        )
        levels = RECOMPUTE_LEVELS if recompute_alternatives else ()
        predicates = list(dict.fromkeys(level.recompute for level in levels))  # one separation each
        if reuse_stages:
            programs, _ = phases.timed(
                "joint+split+cost",
                lambda: _programs_with_reuse(
                    partition, traced.fake_mode, min_deferral_intensity, predicates, reuse_blocks
                ),
            )
        else:
            joints = phases.timed(
                "joint",
                lambda: export_stage_joints(
                    partition, traced.fake_mode, recompute_levels=predicates, reuse_blocks=reuse_blocks
                ),
            )
            splits = phases.timed("split_backward", lambda: [split_backward(j, min_deferral_intensity) for j in joints])
            programs = phases.timed(
                "cost",
                lambda: tuple(
                    StageProgram(stage, joint, split, stage_cost(joint, split))
                    for stage, joint, split in zip(partition.stages, joints, splits)
                ),
            )
        alternatives = ()
        if levels:
            alternatives = phases.timed(
                "recompute", lambda: _recompute_alternatives(partition, programs, predicates, min_deferral_intensity)
            )
    return CompiledPipeline(
        traced, partition, programs, phases.seconds, alternatives=alternatives, phase_cpu_seconds=phases.cpu_seconds
    )


def _recompute_alternatives(
    partition: StagePartition, programs: tuple[StageProgram, ...], predicates: list, min_deferral_intensity: float,
    only: Sequence[int] | None = None,
) -> tuple[tuple[StageProgram, ...], ...]:
    """Per stage, its program and one per level of `RECOMPUTE_LEVELS`, from the joint's
    separation under that level's predicate (`predicates`: the distinct ones, in order); with
    `only`, the other stages get none (an empty tuple)."""
    alternatives = []
    for stage, program in zip(partition.stages, programs):
        if only is not None and stage.index not in only:
            alternatives.append(())
            continue
        chosen = [program]
        for level in RECOMPUTE_LEVELS:
            joint = program.joint.alternatives[predicates.index(level.recompute)]
            intensity = min_deferral_intensity if level.defer_weights else math.inf
            split = split_backward(joint, intensity, level.weight_recomputes)
            chosen.append(StageProgram(stage, joint, split, stage_cost(joint, split)))
        alternatives.append(tuple(chosen))
    return tuple(alternatives)


@dataclass(frozen=True)
class CostedPipeline:
    """A compile for planning: the traced model, its partition and every stage's static cost,
    stages whose programs are identical (`passes/stage_reuse.py`) compiled once:
    `representative[s]` is the stage whose joint, split and cost stage s reuses (s itself for
    the first of each kind)."""

    traced: TracedModel
    partition: StagePartition
    costs: tuple[StageGraphCost, ...]
    representative: tuple[int, ...]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_cpu_seconds: dict[str, float] = field(default_factory=dict)
    annotation: Any = None  # what `compile_costs`'s `annotate` returned
    programs: tuple[StageProgram, ...] = ()  # each stage's programs (a reused stage: its own names)
    # per stage compiled for itself (`representative[s] == s`), its program at each recompute level
    # (index 0: none, then `RECOMPUTE_LEVELS`); the stages reusing another's: empty
    alternatives: tuple[tuple[StageProgram, ...], ...] = ()


def compile_costs(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, args: tuple, kwargs: dict[str, Any], target: Any,
    stages: int, split_points: Sequence[str] | None = None, device: torch.device | None = None,
    min_deferral_intensity: float = MIN_DEFERRAL_INTENSITY, reuse_blocks: bool = True,
    annotate: Callable[[TracedModel], Any] | None = None, cuts: Sequence[int] | None = None,
    traced: TracedModel | None = None, recompute_alternatives: bool = False,
) -> CostedPipeline:
    """What `compile_pipeline` computes of each stage's cost, for a model on the meta device as
    well (nothing is materialised), with the joint export, the I/W split and the cost of stages
    with equal `stage_fingerprint`s done once. Costs equal `compile_pipeline`'s stage for stage.
    The trace records no source lines (errors name the module). Phases are timed in wall-clock
    and in this process's CPU seconds (what a shared machine does not distort). `reuse_blocks`
    and `cuts`: see `compile_pipeline`. `annotate(traced)` runs between the trace and the
    partition (a plan's tensor-parallel shares, `passes/tensor_parallel_shares.py`); what it
    returns is `CostedPipeline.annotation`. `traced`: the model's trace made before (by
    `trace_model` with these inputs; annotating it again for another plan is allowed), not traced
    again. `recompute_alternatives`: every stage compiled for itself also at each level of
    `RECOMPUTE_LEVELS` (`CostedPipeline.alternatives`)."""
    phases = _Phases()
    if traced is None:
        with ti.quiet_torch_logs():
            traced = phases.timed(
                "trace", lambda: trace_model(model, loss_fn, args, kwargs, target, device, record_stack_traces=False)
            )
    annotation = annotate(traced) if annotate is not None else None
    predicates = list(dict.fromkeys(level.recompute for level in RECOMPUTE_LEVELS)) if recompute_alternatives else []
    with ti.quiet_torch_logs(warnings_too=True):
        partition = phases.timed("partition", lambda: partition_stages(traced, stages, split_points, cuts=cuts))
        programs, representative = phases.timed(
            "joint+split+cost",
            lambda: _programs_with_reuse(
                partition, traced.fake_mode, min_deferral_intensity, predicates, reuse_blocks=reuse_blocks
            ),
        )
        alternatives = ()
        if predicates:
            alternatives = phases.timed(
                "recompute",
                lambda: _recompute_alternatives(
                    partition, programs, predicates, min_deferral_intensity, set(representative)
                ),
            )
    costs = tuple(p.cost for p in programs)
    return CostedPipeline(
        traced, partition, costs, representative, phases.seconds, phases.cpu_seconds, annotation, programs, alternatives
    )


def _programs_with_reuse(
    partition: StagePartition, fake_mode: Any, min_deferral_intensity: float, predicates: Sequence[Callable] = (),
    reuse_blocks: bool = True,
) -> tuple[tuple[StageProgram, ...], tuple[int, ...]]:
    """Every stage's program, and the stage it was compiled from: stages are taken last first,
    as `export_stage_joints` takes them (a stage's outputs get gradients where the next stage
    gives them); one whose `stage_fingerprint` was seen takes that stage's joint, split and cost
    under its own names (`stage_reuse.renamed_joint`)."""
    seen: dict[Any, tuple[int, StageJoint, StageIWPrograms, StageGraphCost]] = {}
    programs: dict[int, StageProgram] = {}
    representative: dict[int, int] = {}
    grads_from_next: set[str] = set()
    blocks: dict | None = {} if reuse_blocks else None  # block segments exported so far, for all stages
    last = len(partition.stages) - 1
    for stage in reversed(partition.stages):
        key = stage_fingerprint(stage, partition, grads_from_next, stage.index == last)
        if key not in seen:
            loss = "loss" if stage.index == last else None
            joint, alternatives = export_stage_joint(
                stage, partition, grads_from_next, loss, fake_mode, predicates, blocks
            )
            joint = dataclasses.replace(joint, alternatives=alternatives)
            split = split_backward(joint, min_deferral_intensity)
            seen[key] = (stage.index, joint, split, stage_cost(joint, split))
        first, joint, split, cost = seen[key]
        if first != stage.index:
            mapping = stage_name_map(partition.stages[first], stage)
            joint, split = renamed_joint(joint, stage.index, mapping), renamed_split(split, stage.index, mapping)
        output_grads = tuple(v for v in stage.outputs if v in grads_from_next)
        alternatives = tuple(dataclasses.replace(a, output_grads=output_grads) for a in joint.alternatives)
        joint = dataclasses.replace(joint, output_grads=output_grads, alternatives=alternatives)
        programs[stage.index], representative[stage.index] = StageProgram(stage, joint, split, cost), first
        grads_from_next = set(joint.input_grads) | {v for v in stage.relays if v in grads_from_next}
    order = range(len(partition.stages))
    return tuple(programs[s] for s in order), tuple(representative[s] for s in order)


@dataclass(frozen=True)
class CompiledForward:
    """A forward-only compile (evaluation): the traced model (its loss, or its outputs), its
    partition, one forward program per stage, and the most bytes each program holds at once
    while it runs (`graph_cost.peak_bytes`: what it took in, what it creates)."""

    traced: TracedModel
    partition: StagePartition
    programs: tuple[Program, ...]
    peak_bytes: tuple[int, ...]
    result_names: tuple[str, ...]  # the last stage's results: `loss`, or `output_<i>` per output tensor


def compile_forward_only(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, args: tuple, kwargs: dict[str, Any], target: Any,
    held: Sequence[frozenset[str]], device: torch.device | None = None, outputs: bool = False,
    dynamic: Mapping[str, Sequence[int]] | None = None,
) -> CompiledForward:
    """Compile one microbatch's forward (with its loss, or with `outputs` the model's output) in
    the module's current mode (eval mode: dropout off, BatchNorm's running statistics), cut into
    `len(held)` stages of which stage k reads only the parameters and buffers in `held[k]` (what
    its rank holds, `held_cuts`); `dynamic` as for `compile_pipeline`."""
    with ti.quiet_torch_logs():
        traced = trace_model(model, loss_fn, args, kwargs, target, device, outputs=outputs, dynamic=dynamic)
    with ti.quiet_torch_logs(warnings_too=True):
        partition = partition_stages(traced, len(held), cuts=held_cuts(traced, held))
        last = len(partition.stages) - 1
        result_names = ("loss",) if not outputs else tuple(f"output_{i}" for i in range(traced.results))
        programs = tuple(forward_program(s, result_names if s.index == last else None) for s in partition.stages)
        peaks = tuple(forward_peak(program, stage, partition) for program, stage in zip(programs, partition.stages))
    return CompiledForward(traced, partition, programs, peaks, result_names)

