"""What one compile of a pipelined module builds, kept together in one record (`Build`): the
compiled stages, the runner following the schedule (solved on one rank and broadcast), the cost
tuner and the dump. `Builder` builds and keeps them, one per batch shape, with this process's
layout among the pipelines; the schedule each runs is `schedule_choice.py`'s choice and the
parameters and buffers this process holds `state_ownership.py`'s.

At interpreter exit, while Python still runs, every distributed pipeline lets go of its
compiles and layout (`release_at_exit`): its transports' helper threads are joined and, once
the script has called `dist.destroy_process_group()`, nothing keeps its process groups alive,
so they are freed and their backend's threads (gloo's) end before Python finalizes. A gloo
worker thread frees the tensors of a collective after the caller's wait has returned, taking
the GIL to do so; one doing that as Python finalizes is killed in C++ code, which aborts the
process ("terminate called without an active exception")."""

from __future__ import annotations

import atexit
import functools
import gc
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zbcompile.compiler import CompiledPipeline, compile_forward_only, compile_pipeline
from zbcompile.inspect.write import CompileDump, start_dump
from zbcompile.options import PipelineOptions
from zbcompile.runtime.parallel import batch, batch_loss, sharding, tensor_parallel
from zbcompile.runtime.parallel.layout import Layout, device_for, make_layout
from zbcompile.runtime.state import placement, state_transfer
from zbcompile.runtime.state.state_ownership import StateOwnership
from zbcompile.runtime.step import action_pace
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.step.forward_only import ForwardRunner
from zbcompile.runtime.step.local import InProcessTransport, LocalRunner
from zbcompile.runtime.step.runner import Runner
from zbcompile.runtime.step.transport import stop_helper_threads
from zbcompile.runtime.tuning import calibration, profile, recut
from zbcompile.runtime.tuning.schedule_choice import ScheduleChoice
from zbcompile.schedules import Costs, Schedule, pipeline_ranks, schedule_label, schedule_spec
from zbcompile.stage_compiler import compile_stage_programs


@dataclass(frozen=True)
class Build:
    """One compile: `runner.schedule` is the schedule it runs and `compiled` its stages (the
    runner's: recompute="auto" may choose other levels with measured costs); `tuner` measures
    costs and re-solves (None where costs are not measured); `dump` its files (None when not
    dumping)."""

    runner: Runner
    tuner: profile.CostTuner | None = None
    dump: CompileDump | None = None

    @property
    def compiled(self) -> CompiledPipeline:
        return self.runner.compiled

    def after_step(self, measured: Costs | None) -> Costs | None:
        """After a step (its gradients reduced): record it in the dump, and where the tuner
        switches schedules, run the new one from the next step on. Returns the measured costs
        the running schedule is checked against (`measured` until the tuner has some)."""
        if self.dump is not None:
            self.dump.record_step(self.runner, measured)
        if self.tuner is not None:
            schedule = self.tuner.after_step(self.runner)
            if schedule is not None and schedule is not self.runner.schedule:
                self.runner.reschedule(schedule)
            return self.tuner.measured if self.tuner.measured is not None else measured
        return measured


class Builder:
    """Builds and keeps the compiles of `module` under `options` (`options.PipelineOptions`), one
    per batch shape (`prepare`): the compile cache. Which schedule each runs is `choice`'s job
    (`schedule_choice.ScheduleChoice`), what this process holds `ownership`'s
    (`state_ownership.StateOwnership`)."""

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        self.module = module
        self.choice = ScheduleChoice(options, self.layout)
        self.ownership = StateOwnership(module, options)
        self.builds: dict[Any, Build] = {}  # by compile key (`batch.split`)
        self.forward_builds: dict[Any, ForwardRunner] = {}  # evaluation's, by compile key, results and placement
        self.latest_forward: ForwardRunner | None = None
        self.measured_costs: Costs | None = None  # measured costs the running schedule is checked against
        self.cut_choice: recut.CutChoice | None = None  # the cut chosen by measurement, kept by later compiles
        self._last_key: Any = None
        self._batch = batch.LocalBatch()
        self._layout: Layout | None = None
        self._parallelized = False  # the tensor-parallel plan applied and the model checked
        if options.distributed:
            _DISTRIBUTED.add(self)

    @property
    def options(self) -> PipelineOptions:
        """The pipeline's options, with the schedule and limit `reschedule` set last."""
        return self.choice.options

    def forget_compiles(self) -> None:
        """Drop every compile (the module's mode changed: dropout and friends trace differently)."""
        self.builds.clear()
        self.forward_builds.clear()
        self.latest_forward = None

    def release(self) -> None:
        """Let go of every compile and of the layout, and with them of the process groups (a
        later step builds them again)."""
        self.forget_compiles()
        self._last_key = None
        self._layout = None

    @property
    def distributed(self) -> bool:
        return self.options.distributed

    def layout(self) -> Layout:
        """This rank's place among the pipelines (made on the first call: a collective of the
        ranks of `process_group`, the world by default)."""
        if self._layout is None:
            o = self.options
            pp_size = pipeline_ranks(o.schedule, o.stages)
            self._layout = make_layout(
                pp_size, self.device(), f"schedule {schedule_label(o.schedule)} with stages={o.stages}", o.process_group
            )
        return self._layout

    def device(self) -> torch.device:
        group = self.options.process_group
        return device_for(group.get_group(0) if isinstance(group, DeviceMesh) else group)

    def prepare(self, inputs: tuple, kwargs: dict, target: Any) -> tuple[Build, list, list, tuple[str, ...]]:
        """The compile for this batch (built if its shapes are new), its microbatches and
        targets, and the parts of the batch this rank was not given (`batch.LocalBatch`)."""
        absent: tuple[str, ...] = ()
        if self.distributed:
            inputs, kwargs, target, absent = self._batch.of(
                inputs, kwargs, target, self.layout().pp_group, self.device()
            )
        micro_inputs, micro_targets, key = batch.split(inputs, kwargs, target, self.options.microbatches)
        micro_inputs = batch_loss.with_item_count(self.module, self.options.loss_fn, micro_inputs)
        if key not in self.builds:
            built = self.build(micro_inputs[0], micro_targets[0])
            self.ownership.set_grad_dtype()
            if self._recut_wanted(built):
                built = calibration.calibrated(self, built, micro_inputs, micro_targets, absent)
            o = self.options
            self.builds[key] = replace(
                built, dump=start_dump(o.dump_dir, built.compiled, built.runner.schedule, o, built.runner)
            )
        self._last_key = key
        self.ownership.set_grad_dtype()
        return self.builds[key], micro_inputs, micro_targets, absent

    def _recut_wanted(self, built: Build) -> bool:
        """Whether this compile chooses its cut by measurement (`runtime/tuning/recut.py`): the first
        compile of a distributed zb-auto pipeline that measures its costs, cut by the compiler
        (no split points, no given costs, recompute="auto" aside), unless `recut=False`."""
        o = self.options
        return (
            self.distributed and o.recut and built.tuner is not None and self.cut_choice is None
            and isinstance(o.schedule, str) and schedule_spec(o.schedule).name == "zb-auto"
            and o.split_points is None and o.costs is None and o.recompute != "auto"
            and len(built.compiled.programs) > 1
        )

    def compile_at(self, built: Build, choice: recut.CutChoice, example: tuple) -> Build:
        """The model compiled at `choice`'s cut on every rank, its schedule solved on the
        predicted costs, the state that changes ranks moved there from `built` (`move_state`)."""
        o = self.options
        (args, kwargs), target = example
        cut = choice.cut
        compiled = self.compile_model((args, kwargs), target, cut.stages, built.compiled.memory_unit(), cut.positions)
        device = self.device()
        compiled = replace(compile_stage_programs(compiled, o.compiler, device), cut_record=choice.record)
        schedule = self.choice.schedule(compiled, costs=recut.solve_costs(choice.costs, compiled))
        self._move_state(built.compiled, built.runner.schedule, compiled, schedule, built.runner.transport)
        runner = self._distributed_runner(compiled, schedule, device)
        return Build(runner, self.choice.tuner(compiled, device))

    def move_state(self, source: Build, target: Build) -> None:
        """Hand the parameters, gradients and buffers from where `source`'s ranks read them to
        where `target`'s do (`state_transfer`); this rank then holds what `target` reads here."""
        runner = source.runner
        self._move_state(source.compiled, runner.schedule, target.compiled, target.runner.schedule, runner.transport)

    def _move_state(self, compiled, schedule: Schedule, to_compiled, to_schedule: Schedule, transport) -> None:
        """Move the state from where `compiled` run by `schedule` reads it to where `to_compiled`
        run by `to_schedule` does, over `transport`; record what this rank then holds."""
        layout = self.layout()
        old = state_transfer.holders(compiled, schedule)
        new = state_transfer.holders(to_compiled, to_schedule)
        mine = {f for f, ranks in new.items() if layout.pp_rank in ranks}
        dropped = {f for f, ranks in old.items() if layout.pp_rank in ranks and f not in mine}
        state_transfer.transfer(self.module, self.ownership, state_transfer.moves(old, new), dropped, layout, transport)
        self.ownership.held = mine

    def step(self, inputs: tuple, kwargs: dict, target: Any, before: Sequence[Callable[[], None]]) -> Any:
        """One training step on this batch: its compile (`prepare`) runs it (`Runner.train`, after
        the hooks `before`) and records it (`Build.after_step`). Returns the step's loss."""
        built, micro_inputs, micro_targets, absent = self.prepare(inputs, kwargs, target)
        loss = built.runner.train(micro_inputs, micro_targets, absent, self.ownership, before)
        self.measured_costs = built.after_step(self.measured_costs)
        return loss

    def prepare_forward(
        self, inputs: tuple, kwargs: dict, target: Any, outputs: bool
    ) -> tuple[ForwardRunner, list, list, tuple[str, ...]]:
        """As `prepare`, for evaluation in the module's current mode: the forward-only runner for
        this batch (its loss, or with `outputs` the model's outputs), compiled where the latest
        training compile placed the stages."""
        train = self.latest()
        absent: tuple[str, ...] = ()
        if self.distributed:
            inputs, kwargs, target, absent = self._batch.of(
                inputs, kwargs, target, self.layout().pp_group, self.device()
            )
        if outputs:  # no loss: nothing reads a target
            target, absent = None, tuple(part for part in absent if part != "target")
        micro_inputs, micro_targets, key = batch.split(inputs, kwargs, target, self.options.microbatches)
        if not outputs:
            micro_inputs = batch_loss.with_item_count(self.module, self.options.loss_fn, micro_inputs)
        stage_to_rank = train.runner.schedule.stage_to_rank
        full_key = (key, outputs, stage_to_rank, self.module.training)
        if full_key not in self.forward_builds:
            self.forward_builds[full_key] = self._forward_runner(train, micro_inputs[0], micro_targets[0], outputs)
        self.latest_forward = self.forward_builds[full_key]
        return self.latest_forward, micro_inputs, micro_targets, absent

    def _forward_runner(self, train: Build, example: tuple, example_target: Any, outputs: bool) -> ForwardRunner:
        """Compile the forward alone for microbatches like `example`, each stage reading only what
        its rank holds under `train`'s placement, and the runner of its forward-only schedule."""
        schedule = train.runner.schedule
        stages = train.compiled.partition.stages
        on_rank: dict[int, frozenset[str]] = {}
        for s, stage in enumerate(stages):
            for rank in schedule.ranks_of(s):
                on_rank[rank] = on_rank.get(rank, frozenset()) | set(stage.param_fqns) | set(stage.buffer_fqns)
        held = [on_rank[rank] for rank in schedule.stage_to_rank]
        args, kwargs = example
        loss_fn = None if outputs else self.options.loss_fn
        device = self.device() if self.distributed else None
        compiled = compile_forward_only(self.module, loss_fn, args, kwargs, example_target, held, device, outputs)
        microbatches = self.options.microbatches
        if not self.distributed:
            stage_to_rank = schedule.stage_to_rank
            return ForwardRunner(
                compiled,
                stage_to_rank,
                microbatches,
                range(len(stages)),
                self.ownership.state(),
                InProcessTransport(),
                None,
            )
        runner, layout = train.runner, self.layout()
        mine = [s for s, rank in enumerate(schedule.stage_to_rank) if rank == layout.pp_rank]
        position = (layout.pp_rank, lambda stage, microbatch: layout.pipeline_ranks[schedule.stage_to_rank[stage]])
        return ForwardRunner(
            compiled,
            schedule.stage_to_rank,
            microbatches,
            mine,
            self.ownership.state(),
            runner.transport,
            runner.device,
            position,
        )

    def loss_reduction(
        self, traced: Any, micro_inputs: list, feeds: list, targets: list, held: Any, stages: int
    ) -> batch_loss.LossReduction:
        """How this batch's microbatch losses make its loss (`batch_loss.reduction`); `held`: the
        stages this process runs."""
        layout = self.layout() if self.distributed else None
        return batch_loss.reduction(traced, micro_inputs, feeds, targets, self.module, held, stages, layout)

    def latest(self) -> Build:
        """The compile of the latest step's batch."""
        if self._last_key is None:
            raise RuntimeError("the pipeline compiles on the first step() or compile(); call one of them first")
        return self.builds[self._last_key]

    def reschedule(self, schedule: str | Schedule, memory_limit: Any) -> None:
        """Run `schedule` (a name, or a `Schedule` checked against each compile) under
        `memory_limit` from the next step on in every compile. With recompute="auto" the
        recomputation chosen at compile stays, and so does the limit where `memory_limit` is None."""
        if memory_limit is None and self.options.recompute == "auto":
            memory_limit = self.options.memory_limit
        self.choice.options = replace(self.options, schedule=schedule, memory_limit=memory_limit)
        for key, built in list(self.builds.items()):
            new = self.choice.schedule(built.compiled)
            if new.stages != len(built.compiled.programs):
                raise ValueError(
                    f"schedule {schedule_label(schedule)} runs {new.stages} stages, but this pipeline was compiled in "
                    f"{len(built.compiled.programs)} (zb-auto chose a V of two chunks per rank under its "
                    "memory_limit); "
                    "build a new pipeline for it"
                )
            built.runner.reschedule(new)
            device = self.device() if self.distributed else None
            self.builds[key] = replace(built, tuner=self.choice.tuner(built.compiled, device))

    def build(self, example: tuple, example_target: Any) -> Build:
        """Compile for microbatches like `example` ((args, kwargs)) and `example_target`, in the
        placement zb-auto chooses (`ScheduleChoice.placed`)."""
        o = self.options
        if self.distributed:
            self._parallelize()
        compile_in = functools.partial(self.compile_model, example, example_target)
        compiled, schedule = self._at_chosen_cut(compile_in) or self.choice.placed(compile_in(o.stages), compile_in)
        device = self.device() if self.distributed else batch.device_of((example, example_target))
        compiled = compile_stage_programs(compiled, o.compiler, device)
        if self.distributed:
            runner = self._distributed_runner(compiled, schedule, device)
        else:
            self.ownership.place(set(placement.canonical_names(self.module).values()), device, move_others=False)
            runner = LocalRunner(compiled, schedule, self.ownership.state())
        return Build(runner, self.choice.tuner(compiled, device))

    def _at_chosen_cut(self, compile_in: Callable[..., CompiledPipeline]) -> tuple[CompiledPipeline, Schedule] | None:
        """A later compile (new batch shapes) at the cut chosen by measurement, where its graph
        cuts there; None where none was chosen or it does not."""
        if self.cut_choice is None:
            return None
        cut = self.cut_choice.cut
        try:
            compiled = compile_in(cut.stages, None, cut.positions)
        except ValueError:
            return None
        return compiled, self.choice.schedule(compiled)

    def _parallelize(self) -> None:
        """Before the first compile: the `tensor_parallel` plan applied on the mesh's "tp"
        dimension (`tensor_parallel.apply_plan`), and the model checked against the layout."""
        if self._parallelized:
            return
        layout = self.layout()
        if self.options.tensor_parallel is not None:
            tensor_parallel.apply_plan(self.module, self.options.tensor_parallel, layout)
        tensor_parallel.check_model(self.module, layout)
        self._parallelized = True

    def compile_model(
        self,
        example: tuple,
        example_target: Any,
        stages: int,
        memory_unit_bytes: int | None = None,
        cuts: Sequence[int] | None = None,
    ) -> CompiledPipeline:
        """The model cut into `stages` stages (at `cuts` where given; recompute="auto" applied),
        before the stage programs are compiled; memory counted in units of `memory_unit_bytes`
        where given."""
        args, kwargs = example
        o = self.options
        device = self.device() if self.distributed else None
        compiled = compile_pipeline(
            self.module, o.loss_fn, args, kwargs, example_target, stages, o.split_points, device,
            recompute_alternatives=o.recompute == "auto", cuts=cuts,
        )
        if memory_unit_bytes is not None:
            compiled = replace(compiled, memory_unit_bytes=memory_unit_bytes)
        if o.recompute == "auto":
            compiled = self.choice.fit_memory_by_recomputing(compiled)
        return compiled

    def owned_only(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of the module's `state_dict` this rank reports (every alias of a tied
        weight included): all of them in one process; together over all ranks, the model's."""
        if not self.distributed:
            return state_dict
        self.ownership.require_placed()
        built = self.latest()
        owned = placement.owned_names(built.compiled, built.runner.schedule, built.runner.layout.pp_rank)
        aliases = placement.canonical_names(self.module)
        return {k: v for k, v in state_dict.items() if aliases.get(k, k) in owned}

    def _distributed_runner(
        self, compiled: CompiledPipeline, schedule: Schedule, device: torch.device
    ) -> DistributedRunner:
        layout = self.layout()
        if schedule.ranks != layout.pp_size:
            raise ValueError(
                f"schedule {schedule_label(schedule)} runs on {schedule.ranks} ranks per pipeline, but this pipeline "
                "was laid "
                f"out for {layout.pp_size}; build a new pipeline for it"
            )
        local_stages = schedule.stages_on(layout.pp_rank)
        used = {
            f
            for s in local_stages
            for f in (*compiled.partition.stages[s].param_fqns, *compiled.partition.stages[s].buffer_fqns)
        }

        def runner() -> DistributedRunner:
            o = self.options
            made = DistributedRunner(
                compiled,
                schedule,
                layout,
                self.ownership.state(),
                device,
                o.timeout,
                o.follow_readiness,
                o.data_parallel,
            )
            action_pace.install(made.interpreter, made.rank, schedule.stages, o._slowdown, o._emulate)
            return made

        if self.ownership.held is not None:
            if used - self.ownership.held:
                raise ValueError(
                    f"these batch shapes cut the model differently from the first compile, and this rank does not "
                    f"hold {sorted(used - self.ownership.held)[:4]}; pass split_points=[...] to pipeline() to fix the "
                    "cut"
                )
            return runner()
        self.ownership.check_shardable(layout)
        # the runner shares tied weights' values between ranks: after placement, undone if it fails
        built = self.ownership.place(used, device, move_others=True, then=runner)
        if self.options.data_parallel == "shard":  # the replicas' values are equal now: each keeps its shard
            sharding.shard_parameters(self.module, self.ownership.held, layout.mesh)
        return built


_DISTRIBUTED: weakref.WeakSet[Builder] = weakref.WeakSet()  # the distributed pipelines' builders


@atexit.register
def release_at_exit() -> None:
    """At interpreter exit (see the module docstring): join the transports' helper threads, let
    every distributed pipeline go of its compiles and layout, and free what that leaves unused."""
    stop_helper_threads()
    builders = list(_DISTRIBUTED)
    for builder in builders:
        builder.release()
    if builders:
        gc.collect()  # compiles and runners refer to each other: freed by a collection
