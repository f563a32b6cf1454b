"""Runs this rank's part of a pipeline step with torch.distributed: the interpreter
(`runtime/step/dispatch.py`) follows its program (`runtime/step/rank_program.py`: the lowered action list of F,
I, W, B and SEND/RECV) over point-to-point messages (`runtime/step/transport.py`); each stage's gradients
are averaged over data-parallel replicas from its last W or B on, in the background
(`runtime/parallel/grad_reduction.py`), and after the step the runner sums tied weights' gradients
between the ranks that hold them and averages those over the replicas too. With
data_parallel="shard" the parameters are DTensor shards gathered for the step
(`runtime/parallel/sharding.py`). Where stages sit: `runtime/parallel/layout.py`.

A mirrored schedule (dualpipe, `Schedule.mirrored_from`) runs every stage on two ranks, one per
copy of the pipeline, each for its share of the microbatches: both ranks hold the stage's
parameters, which are kept equal like tied weights' (the same value at start, each copy's
gradient summed, copy 0's first, on both), and the last stage's rank of copy 1 hands its
microbatch losses to that of copy 0, which returns them all.

Following readiness (the default): the program runs W after the sends the plan put them before
(`program.defer_weights`), and when a computation's message has not arrived yet, the rank runs
its next W in the meantime (see `runtime/step/dispatch.py`). So a late message costs no more than the
plan, and a message on time is not held up by a W the plan put before it."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.parallel import tensor_parallel
from zbcompile.runtime.parallel.batch import ReplicaBatches
from zbcompile.runtime.parallel.grad_reduction import REDUCE, GradReduction, ReductionPlan
from zbcompile.runtime.parallel.layout import Layout
from zbcompile.runtime.parallel.sharding import Gathered
from zbcompile.runtime.step.action_clock import EventClock, HostClock
from zbcompile.runtime.step.action_pace import EmulatedReduction
from zbcompile.runtime.step.rank_program import RankProgram, rank_program
from zbcompile.runtime.step.runner import Runner
from zbcompile.runtime.step.stage import StageExecutor
from zbcompile.runtime.step.tied_weights import (
    TIED_TAG,
    parameter_users,
    share_owner_values,
    sum_gradients,
    tied_weights,
)
from zbcompile.runtime.step.transport import Transport
from zbcompile.schedules import Costs, Schedule
from zbcompile.schedules.costs import resolve_costs
from zbcompile.value_names import buffer_name, param_name

MIRRORED_LOSS_TAG = TIED_TAG - 1  # above post-validation's tags, below the tied weights'


def _placement_text(schedule: Schedule) -> str:
    """Where `schedule` runs its stages, in words."""
    if schedule.mirrored_from is None:
        return str(schedule.stage_to_rank)
    mirrored = tuple(schedule.rank_of(s, schedule.mirrored_from) for s in range(schedule.stages))
    return f"{schedule.stage_to_rank} and, from microbatch {schedule.mirrored_from} on, {mirrored}"


class DistributedRunner(Runner):
    """Executes one rank's stages of a compiled pipeline, step after step. With
    `follow_readiness` (see the module docstring) W may run elsewhere than the plan says, in the
    plan's order per rank; `moved_w` tells which did in the last step. `data_parallel`: how
    replicas keep parameters, "replicate" (whole on every replica) or "shard" (DTensors sharded
    over "dp", `runtime/parallel/sharding.py`: gathered for each step, gradients reduce-scattered)."""

    def __init__(
        self,
        compiled: CompiledPipeline,
        schedule: Schedule,
        layout: Layout,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        timeout: timedelta,
        follow_readiness: bool = True,
        data_parallel: str = "replicate",
    ) -> None:
        self.layout = layout
        self.device = device
        self.rank = dist.get_rank()
        self.data_parallel = data_parallel
        self.overlap_reduction = True  # False: every gradient reduced after the drain (for measurements)
        # a rehearsal aid (`runtime/step/action_pace.py`): per stage, the seconds of a gradient reduction over
        # emulated replicas, where the pipeline has none; () or zeros: none
        self.emulated_reduction: tuple[float, ...] = ()
        self._reduction: GradReduction | EmulatedReduction | None = None
        self._state: Mapping[str, torch.Tensor] = state
        executors = {s: StageExecutor(compiled.programs[s], state) for s in schedule.stages_on(layout.pp_rank)}
        clock = EventClock() if device.type == "cuda" else HostClock()
        transport = Transport(self.rank, timeout, layout.pp_group)
        super().__init__(compiled, schedule, executors, transport, device, follow_readiness, clock)
        self.interpreter.step_timeout_s = timeout.total_seconds()
        users = parameter_users(compiled.partition)
        self.tied_weights = tied_weights(users, schedule.ranks_of, layout.pipeline_ranks, self.rank)
        self._synchronize_state(state)

    def _synchronize_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Start every copy of a parameter equal: a tied weight's copies take its owner's value,
        and replicas take replica 0's (each rank may have initialised its own)."""
        # shards: kept equal
        whole = [t for t in self.tied_weights if not isinstance(state[param_name(t.fqn)], DTensor)]
        with torch.no_grad():
            share_owner_values(whole, state, self.transport)
            if self.layout.dp_group is not None:
                source = self.layout.replica_ranks[0]
                for s in self.local_stages:
                    stage = self.compiled.partition.stages[s]
                    for name in [*map(param_name, stage.param_fqns), *map(buffer_name, stage.buffer_fqns)]:
                        if not isinstance(state[name], DTensor):
                            dist.broadcast(state[name], src=source, group=self.layout.dp_group)

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Parameters and buffers the next step computes with (sharded ones gathered in the step)."""
        self._state = state
        super().set_state(state)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The global rank running `stage` for `microbatch`."""
        return self.layout.pipeline_ranks[self.schedule.rank_of(stage, microbatch)]

    def step(self, inputs, targets, loss_tangent: float | None = None) -> list[torch.Tensor] | None:
        """One step; returns every microbatch's loss on the rank of the last stage (of copy 0,
        under a mirrored schedule), else None. With data-parallel replicas, three things start
        here that `reduce_grads()` (which must follow) finishes: the check that every replica got
        a batch of one size, the gathering of sharded parameters ("shard"), and the gradient
        reduction that each stage's last W or B posts."""
        if self.layout.dp_group is not None:
            first = next(iter([*inputs[0].values(), *targets[0].values()]))
            size = len(inputs) * first.shape[0]
            self._replica_batches = ReplicaBatches(size, self.layout.dp_group, self.layout.replica_ranks, self.device)
            gathered = None
            if self.data_parallel == "shard":
                gathered = Gathered(self._state, self._stage_params(), self.layout.dp_group, self.transport.timeout)
                super().set_state(gathered)
            self._reduction = self._grad_reduction(gathered)
            self.interpreter.grads_accumulated = self._reduction.ran
        elif any(self.emulated_reduction):
            self._reduction = EmulatedReduction(self._reduction_plan(), self.emulated_reduction)
            self.interpreter.grads_accumulated = self._reduction.ran
        losses = super().step(inputs, targets, loss_tangent)
        schedule = self.schedule
        if schedule.mirrored_from is None:
            return losses
        last, first_mirrored = schedule.stages - 1, schedule.mirrored_from
        reporter, mirrored = self.rank_of(last, 0), self.rank_of(last, first_mirrored)
        action = "handing the mirrored copy's microbatch losses over"
        if self.rank == mirrored:
            self.transport.send([torch.stack(losses)], reporter, MIRRORED_LOSS_TAG, action)
            self.transport.complete_messages()
            return None
        if self.rank == reporter:
            buffer = torch.empty(len(inputs) - first_mirrored, dtype=losses[0].dtype, device=losses[0].device)
            pending = self.transport.post_recv([buffer], mirrored, MIRRORED_LOSS_TAG, action)
            return losses + list(self.transport.wait(pending, action)[0].unbind())
        return losses

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        """This rank's parameter gradients for the step: its stages' parts summed in stage order,
        tied weights summed with the other ranks that hold them, then averaged over replicas (a
        stage's own gradients in the background since its last W or B, `runtime/parallel/grad_reduction.py`;
        the others now); a replicated parameter's partial sum over the tensor-parallel ranks (a
        SequenceParallel norm's weight) summed over them last."""
        grads = self._stage_grads()
        sum_gradients(self.tied_weights, grads, self.executors[self.local_stages[0]].state, self.transport)
        if self.layout.dp_group is not None:
            self._replica_batches.check(self.transport.timeout)
            reduction, self._reduction = self._reduction, None
            self.interpreter.grads_accumulated = lambda stage: None
            reduced = reduction.finish()
            rest = [f for f in sorted(grads) if f not in reduced]
            reduced.update(reduction.reduce_now(rest, grads, f"{REDUCE} (after the step)"))
            grads.update(reduced)
            self.interpreter.comm_timeline = [*self.interpreter.comm_timeline, *reduction.timeline]
            super().set_state(self._state)  # sharded: the gathered parameters are freed
        elif self._reduction is not None:  # emulated replicas: the step ends when their reductions have
            reduction, self._reduction = self._reduction, None
            self.interpreter.grads_accumulated = lambda stage: None
            reduction.finish()
            self.interpreter.comm_timeline = [*self.interpreter.comm_timeline, *reduction.timeline]
        partial = [f for s in self.local_stages for f in self.compiled.programs[s].joint.partial_grads]
        tensor_parallel.reduce_partial_grads(grads, partial, self.layout.tp_group, self.transport.timeout)
        return grads

    def _grad_reduction(self, gathered: Gathered | None) -> GradReduction:
        """This step's reduction over the replicas, following this rank's program (reduce-scatter
        into DTensor shards, releasing the gathered parameters, where `gathered`)."""
        plan = self._reduction_plan()
        if not self.overlap_reduction:
            plan = replace(plan, overlapped={s: frozenset() for s in plan.overlapped})
        grads_of = lambda stage: self.executors[stage].grads  # noqa: E731
        reduction = GradReduction(plan, self.layout.dp_group, self.layout.dp_size, grads_of, self.transport.timeout)
        if gathered is not None:
            reduction.mesh, reduction.released = self.layout.mesh["dp"], gathered.release
        return reduction

    def _reduction_plan(self) -> ReductionPlan:
        """When and in what order this rank's program makes each stage's gradients final."""
        partition = self.compiled.partition
        return ReductionPlan.of(
            self.program.actions, {s: partition.stages[s].param_fqns for s in self.local_stages},
            [t.fqn for t in self.tied_weights],
        )

    def _stage_params(self) -> dict[int, list[str]]:
        """This rank's stages' parameters (runtime names), stages in the order they first act."""
        first: dict[int, int] = {}
        for index, action in enumerate(self.program.actions):
            if action.is_compute:
                first.setdefault(action.stage, index)
        stages = self.compiled.partition.stages
        order = sorted(self.local_stages, key=lambda s: first.get(s, 0))
        return {s: [param_name(f) for f in stages[s].param_fqns] for s in order}

    def reschedule(self, schedule: Schedule) -> None:
        """Run `schedule` from the next step on (same stages on the same ranks)."""
        if schedule.placement != self.schedule.placement:
            raise ValueError(
                f"schedule {schedule.name!r} places stages on ranks {_placement_text(schedule)}, but this pipeline "
                f"runs them on {_placement_text(self.schedule)}; build a new pipeline for it"
            )
        super().reschedule(schedule)

    def _program(self, schedule: Schedule) -> RankProgram:
        programs = self.compiled.programs
        memory = None
        if self.follow_readiness:  # the memory model the schedule was validated with (bytes)
            costs = Costs(mem_b=[p.cost.mem_b for p in programs], mem_w=[p.cost.mem_w for p in programs])
            memory = resolve_costs(costs, schedule.stages)
        return rank_program(
            schedule, self.layout.pp_rank, self.rank_of, self._message_names, self._value_layout, memory
        )

