"""What one compile of a pipelined module builds, kept together in one record (`Build`): the
compiled stages, the runner following the schedule (solved on one rank and broadcast), the cost
tuner and the dump. `Builder` keeps them, one per batch shape, with this process's layout among
the pipelines; `Assembly` makes them, `Evaluation` evaluation's forward-only ones. The schedule
each runs is `schedule_choice.py`'s choice, the parameters and buffers this process holds
`state_ownership.py`'s.

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
from zbcompile.runtime.compile_cache import CompileCache, fitting_schedule, sizes_text, step_label
from zbcompile.runtime.parallel import batch, batch_loss, sharding, tensor_parallel
from zbcompile.runtime.parallel.layout import Layout, device_for, make_layout
from zbcompile.runtime.state import placement, state_transfer
from zbcompile.runtime.state.state_ownership import StateOwnership
from zbcompile.runtime.step import action_pace
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.step.forward_only import ForwardRunner
from zbcompile.runtime.step.local import InProcessTransport, LocalRunner
from zbcompile.runtime.step.runner import Runner
from zbcompile.runtime.step.stage_compiler import compile_stage_programs
from zbcompile.runtime.step.transport import stop_helper_threads
from zbcompile.runtime.tuning import calibration, profile, recut
from zbcompile.runtime.tuning.schedule_choice import ScheduleChoice
from zbcompile.schedules import Costs, Schedule, pipeline_ranks, schedule_label, schedule_spec


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


# symbolic sizes through DTensor's tensor-parallel ops recurse without end in AOTAutograd's trace (torch 2.13)
_NOT_SHAPE_GENERIC = "tensor parallelism compiles per shape: its DTensor ops do not trace with symbolic sizes"


class Builder:
    """Keeps the compiles of `module` under `options` (`options.PipelineOptions`), one per batch
    shape (`prepare`; made by `assembly`, evaluation's in `evaluation`), with this process's layout
    among the pipelines. Which schedule each runs is `choice`'s job (`schedule_choice.ScheduleChoice`),
    what this process holds `ownership`'s (`state_ownership.StateOwnership`)."""

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        self.module = module
        self.choice = ScheduleChoice(options, self.layout)
        self.ownership = StateOwnership(module, options)
        self.assembly = Assembly(self)
        self.evaluation = Evaluation(self)
        self.cache = CompileCache(options.dynamic, _NOT_SHAPE_GENERIC if options.tensor_parallel else None)
        self.measured_costs: Costs | None = None  # measured costs the running schedule is checked against
        self.cut_choice: recut.CutChoice | None = None  # the cut chosen by measurement, kept by later compiles
        self._batch = batch.LocalBatch()
        self._last_key = self._layout = self._device = None  # the layout: made on the first distributed step
        self._training = module.training  # the module's mode the compiles were made in
        self._values: dict | None = None  # the latest step's symbol values (a shape-generic compile's)
        self._fitting: dict[Any, dict[float, Schedule]] = {}  # per compile, schedules for longer sizes' memory
        if options.distributed:
            _DISTRIBUTED.add(self)

    @property
    def options(self) -> PipelineOptions:
        """The pipeline's options, with the schedule and limit `reschedule` set last."""
        return self.choice.options

    @property
    def distributed(self) -> bool:
        return self._layout is not None or self.options.distributed

    @property
    def builds(self) -> dict[Any, Build]:
        """The compiles, by the compile key (`batch.split`) of the batch each was made for."""
        return self.cache.builds

    def forget_compiles(self) -> None:
        """Drop every compile."""
        self.cache.clear()
        self.evaluation = Evaluation(self)

    def release(self) -> None:
        """Let go of every compile and of the layout with its process groups (a later step builds them again)."""
        self.forget_compiles()
        self._last_key = self._layout = self._device = None

    def layout(self) -> Layout:
        """This rank's place among the pipelines, made on the first call (a collective of `process_group`'s ranks)."""
        if self._layout is None:
            o = self.options
            what = f"schedule {schedule_label(o.schedule)} with stages={o.stages}"
            self._layout = make_layout(pipeline_ranks(o.schedule, o.stages), self.device(), what, o.process_group)
            self._device = self.device()  # settled by the layout (on CUDA, this rank's GPU)
        return self._layout

    def device(self) -> torch.device:
        """The backend's device (`device_for` the process group), kept once the layout settles it."""
        group = self.options.process_group
        return self._device or device_for(group.get_group(0) if isinstance(group, DeviceMesh) else group)

    def split(self, inputs: tuple, kwargs: dict, target: Any, loss: bool = True) -> tuple[list, list, Any, tuple]:
        """This rank's microbatches and targets of the batch, its compile key (`batch.split`) and
        the parts of the batch it was not given (`batch.LocalBatch`); without `loss`, no target."""
        absent: tuple[str, ...] = ()
        if self.distributed:
            group = self.layout().pp_group
            every_step = self.cache.shape_generic()  # sizes change without a compile: agreed every step
            inputs, kwargs, target, absent = self._batch.of(inputs, kwargs, target, group, self.device(), every_step)
        if not loss:  # nothing reads a target
            target, absent = None, tuple(part for part in absent if part != "target")
        micro_inputs, micro_targets, key = batch.split(inputs, kwargs, target, self.options.microbatches)
        if loss:
            micro_inputs = batch_loss.with_item_count(self.module, self.options.loss_fn, micro_inputs)
        return micro_inputs, micro_targets, key, absent

    def prepare(self, inputs: tuple, kwargs: dict, target: Any) -> tuple[Build, list, list, tuple[str, ...]]:
        """The compile for this batch (made if its shapes are new), its microbatches and targets,
        and the parts of the batch this rank was not given (`split`)."""
        micro_inputs, micro_targets, key, absent = self.split(inputs, kwargs, target)
        if self.builds and self._training != self.module.training:
            self.cache.clear()  # the module's mode changed: dropout and friends trace differently
        self._training = self.module.training
        leaves = batch.leaf_tensors(*micro_inputs[0], micro_targets[0])
        served = self.cache.serving(key, leaves)
        if served is None:
            build = functools.partial(self.assembly.build, micro_inputs, micro_targets, absent)
            self.cache.compile(key, leaves, lambda dims: build(dynamic=dims))
            served = key
        self._last_key = served
        symbols = self.builds[served].compiled.traced.symbols
        self._values = symbols.bind(leaves) if symbols is not None else None  # the step's symbol values
        self._sizes = sizes_text(self._values, leaves)
        self.ownership.set_grad_dtype()
        return self.builds[served], micro_inputs, micro_targets, absent

    def step(self, inputs: tuple, kwargs: dict, target: Any, before: Sequence[Callable[[], None]]) -> Any:
        """One training step on this batch: its compile (`prepare`) runs it (`Runner.train`, after
        the hooks `before`) and records it (`Build.after_step`). Returns the step's loss."""
        built, micro_inputs, micro_targets, absent = self.prepare(inputs, kwargs, target)
        runner, running = built.runner, built.runner.schedule
        fitting = None if not self._values else fitting_schedule(
            built.compiled, running, self._values, self.options.memory_limit,
            self._fitting.setdefault(self._last_key, {}),
            lambda costs: self.choice.schedule(built.compiled, costs=costs),
        )
        if fitting is not None:  # these sizes' activations need a schedule of less memory: this step runs it
            runner.reschedule(fitting)
        try:
            loss = runner.train(micro_inputs, micro_targets, absent, self.ownership, before)
        finally:
            if fitting is not None:
                runner.reschedule(running)
        self.cache.ran(self._sizes, step_label(fitting or running))
        self.measured_costs = built.after_step(self.measured_costs)
        return loss

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
                    f"{len(built.compiled.programs)} (zb-auto chose a V of two chunks per rank under its memory_limit)"
                    "; build a new pipeline for it"
                )
            built.runner.reschedule(new)
            device = self.device() if self.distributed else None
            self.builds[key] = replace(built, tuner=self.choice.tuner(built.compiled, device))

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


class Assembly:
    """Makes `builder`'s compiles (`Build`): the model cut (at the cut chosen by measurement where
    the graph cuts there, else in the placement zb-auto chooses), its stage programs and runner,
    the first compile's cut chosen by measurement (`calibration.calibrated`); and a compile at
    another cut, the state moved there (`compile_at`, `move_state`)."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self._parallelized = False  # the tensor-parallel plan applied and the model checked
        self._dynamic: Any = None  # the symbolic dimensions of the compile being built (every cut of it)

    def build(self, micro_inputs: list, micro_targets: list, absent: tuple[str, ...], dynamic: Any = None) -> Build:
        """The compile for microbatches like these (`dynamic`: the dimensions of each input leaf
        traced as symbols, `compile_cache.py`), calibrated where its cut is chosen by measurement
        (`_recut_wanted`), with its dump started."""
        b, o = self.builder, self.builder.options
        self._dynamic = dynamic
        example, example_target = micro_inputs[0], micro_targets[0]
        if b.distributed:
            self._parallelize()
        compile_in = functools.partial(self.compile_model, example, example_target)
        compiled, schedule = self._at_chosen_cut(compile_in) or b.choice.placed(compile_in(o.stages), compile_in)
        device = b.device() if b.distributed else batch.device_of((example, example_target))
        compiled = compile_stage_programs(compiled, o.compiler, device)
        if b.distributed:
            runner = _distributed_runner(b, compiled, schedule, device)
        else:
            b.ownership.place(set(placement.canonical_names(b.module).values()), device, move_others=False)
            runner = LocalRunner(compiled, schedule, b.ownership.state())
        built = Build(runner, b.choice.tuner(compiled, device))
        b.ownership.set_grad_dtype()
        if _recut_wanted(o, built, b.cut_choice):
            built = calibration.calibrated(b, built, micro_inputs, micro_targets, absent)
        return replace(built, dump=start_dump(o.dump_dir, built.compiled, built.runner.schedule, o, built.runner))

    def _at_chosen_cut(self, compile_in: Callable[..., CompiledPipeline]) -> tuple[CompiledPipeline, Schedule] | None:
        """A later compile (new batch shapes) at the cut the pipeline runs, each stage reading the
        parameters it reads there; a first compile at the cut chosen by measurement where one was
        given; None where neither is, or where the graph does not cut there."""
        earlier, choice = next(iter(self.builder.builds.values()), None), self.builder.cut_choice
        if earlier is not None:
            partition = earlier.compiled.partition
            stage_params = tuple(frozenset(stage.param_fqns) for stage in partition.stages)
            stages, cuts = len(stage_params), partition.cuts
        elif choice is not None:
            stage_params, stages, cuts = None, choice.cut.stages, choice.cut.positions
        else:
            return None
        try:
            compiled = compile_in(stages, None, cuts, stage_params)
        except ValueError:
            return None
        return compiled, self.builder.choice.schedule(compiled)

    def compile_at(self, built: Build, choice: recut.CutChoice, example: tuple) -> Build:
        """The model compiled at `choice`'s cut on every rank, its schedule solved on the
        predicted costs, the state that changes ranks moved there from `built` (`move_state`)."""
        b, cut = self.builder, choice.cut
        inputs, target = example
        compiled = self.compile_model(inputs, target, cut.stages, built.compiled.memory_unit(), cut.positions)
        device = b.device()
        compiled = replace(compile_stage_programs(compiled, b.options.compiler, device), cut_record=choice.record)
        schedule = b.choice.schedule(compiled, costs=recut.solve_costs(choice.costs, compiled))
        _move_state(b, (built.compiled, built.runner.schedule), (compiled, schedule), built.runner.transport)
        return Build(_distributed_runner(b, compiled, schedule, device), b.choice.tuner(compiled, device))

    def move_state(self, source: Build, target: Build) -> None:
        """Hand the parameters, gradients and buffers from where `source`'s ranks read them to
        where `target`'s do (`state_transfer`); this rank then holds what `target` reads here."""
        to = (target.compiled, target.runner.schedule)
        _move_state(self.builder, (source.compiled, source.runner.schedule), to, source.runner.transport)

    def _parallelize(self) -> None:
        """Before the first compile: the `tensor_parallel` plan applied on the mesh's "tp"
        dimension (`tensor_parallel.apply_plan`), and the model checked against the layout."""
        if self._parallelized:
            return
        module, layout = self.builder.module, self.builder.layout()
        if self.builder.options.tensor_parallel is not None:
            tensor_parallel.apply_plan(module, self.builder.options.tensor_parallel, layout)
        tensor_parallel.check_model(module, layout)
        self._parallelized = True

    def compile_model(
        self, example: tuple, example_target: Any, stages: int, memory_unit_bytes: int | None = None,
        cuts: Sequence[int] | None = None, stage_params: Sequence[frozenset[str]] | None = None,
    ) -> CompiledPipeline:
        """The model cut into `stages` stages (at `cuts` where given, each stage reading
        `stage_params[k]` where given: `partition_stages`; recompute="auto" applied), before the
        stage programs are compiled; memory counted in units of `memory_unit_bytes` where given.
        A shape-generic compile that fails compiles for this shape (`CompileCache.compiles_per_shape`)."""
        b, o = self.builder, self.builder.options
        args, kwargs = example
        compile_in = functools.partial(
            compile_pipeline, b.module, o.loss_fn, args, kwargs, example_target, stages, o.split_points,
            b.device() if b.distributed else None, recompute_alternatives=o.recompute == "auto", cuts=cuts,
            stage_params=stage_params,
        )
        compiled = b.cache.compile_or_fall_back(self._dynamic, lambda dims: compile_in(dynamic=dims))
        if compiled.traced.symbols is None:  # the build's other cuts compile for this shape too
            self._dynamic = None
        if memory_unit_bytes is not None:
            compiled = replace(compiled, memory_unit_bytes=memory_unit_bytes)
        if o.recompute == "auto":
            compiled = b.choice.fit_memory_by_recomputing(compiled)
        return compiled


def _distributed_runner(
    builder: Builder, compiled: CompiledPipeline, schedule: Schedule, device: torch.device
) -> DistributedRunner:
    """This rank's runner of `compiled` under `schedule`. The first compile places the state its
    stages read here (sharded over the replicas with data_parallel="shard"); a later one must
    read only what this rank holds."""
    layout, ownership, o = builder.layout(), builder.ownership, builder.options
    if schedule.ranks != layout.pp_size:
        raise ValueError(
            f"schedule {schedule_label(schedule)} runs on {schedule.ranks} ranks per pipeline, but this pipeline "
            f"was laid out for {layout.pp_size}; build a new pipeline for it"
        )
    stages = compiled.partition.stages
    used = {f for s in schedule.stages_on(layout.pp_rank) for f in (*stages[s].param_fqns, *stages[s].buffer_fqns)}

    def runner() -> DistributedRunner:
        made = DistributedRunner(
            compiled, schedule, layout, ownership.state(), device, o.timeout, o.follow_readiness, o.data_parallel
        )
        action_pace.install(made, made.rank, schedule.stages, o._slowdown, o._emulate)
        return made

    if ownership.held is not None:
        if used - ownership.held:
            raise ValueError(
                f"these batch shapes cut the model differently from the first compile, and this rank does not "
                f"hold {sorted(used - ownership.held)[:4]}; pass split_points=[...] to pipeline() to fix the cut"
            )
        return runner()
    ownership.check_shardable(layout)
    # the runner shares tied weights' values between ranks: after placement, undone if it fails
    built = ownership.place(used, device, move_others=True, then=runner)
    if o.data_parallel == "shard":  # the replicas' values are equal now: each keeps its shard
        sharding.shard_parameters(builder.module, ownership.held, layout.mesh)
    return built


def _recut_wanted(o: PipelineOptions, built: Build, cut_choice: recut.CutChoice | None) -> bool:
    """Whether this compile chooses its cut by measurement (`runtime/tuning/recut.py`): the first
    compile of a distributed zb-auto pipeline that measures its costs, cut by the compiler
    (no split points, no given costs, recompute="auto" aside), unless `recut=False`."""
    return (
        o.distributed and o.recut and built.tuner is not None and cut_choice is None
        and isinstance(o.schedule, str) and schedule_spec(o.schedule).name == "zb-auto"
        and o.split_points is None and o.costs is None and o.recompute != "auto"
        and len(built.compiled.programs) > 1
    )


def _move_state(builder: Builder, source: tuple, target: tuple, transport: Any) -> None:
    """Move the state from where `source` (a compile and the schedule running it) reads it to
    where `target` does, over `transport`; record what this rank then holds."""
    layout, ownership = builder.layout(), builder.ownership
    old, new = state_transfer.holders(*source), state_transfer.holders(*target)
    mine = {f for f, ranks in new.items() if layout.pp_rank in ranks}
    dropped = {f for f, ranks in old.items() if layout.pp_rank in ranks and f not in mine}
    state_transfer.transfer(builder.module, ownership, state_transfer.moves(old, new), dropped, layout, transport)
    ownership.held = mine


class Evaluation:
    """Evaluation's compiles in the module's current mode, each compiled where the latest training
    compile placed the stages: a forward-only runner per batch shape, results and placement
    (`prepare`); `latest` ran the latest evaluation."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.caches: dict[Any, CompileCache] = {}  # runners by results, placement and mode, then batch shape
        self.latest: ForwardRunner | None = None

    def prepare(
        self, inputs: tuple, kwargs: dict, target: Any, outputs: bool
    ) -> tuple[ForwardRunner, list, list, tuple[str, ...]]:
        """As `Builder.prepare`, for evaluation: the forward-only runner for this batch (its loss,
        or with `outputs` the model's outputs), its microbatches and targets, the parts absent."""
        train = self.builder.latest()
        micro_inputs, micro_targets, key, absent = self.builder.split(inputs, kwargs, target, loss=not outputs)
        context = (outputs, train.runner.schedule.stage_to_rank, self.builder.module.training)
        made = self.builder.cache
        cache = self.caches.setdefault(context, CompileCache(made.dynamic, made.unsupported))
        leaves = batch.leaf_tensors(*micro_inputs[0], micro_targets[0])
        served = cache.serving(key, leaves)
        if served is None:
            runner = functools.partial(self._runner, train, micro_inputs[0], micro_targets[0], outputs)
            cache.compile(key, leaves, lambda dims: cache.compile_or_fall_back(dims, runner))
            served = key
        self.latest = cache.builds[served]
        return self.latest, micro_inputs, micro_targets, absent

    def _runner(
        self, train: Build, example: tuple, example_target: Any, outputs: bool, dynamic: Any = None
    ) -> ForwardRunner:
        """Compile the forward alone for microbatches like `example` (`dynamic`: the dimensions
        of each input leaf traced as symbols), each stage reading only what its rank holds under
        `train`'s placement, and the runner of its forward-only schedule."""
        b, schedule = self.builder, train.runner.schedule
        stages = train.compiled.partition.stages
        readers = state_transfer.holders(train.compiled, schedule)
        held = [frozenset(f for f, ranks in readers.items() if rank in ranks) for rank in schedule.stage_to_rank]
        args, kwargs = example
        loss_fn = None if outputs else b.options.loss_fn
        device = b.device() if b.distributed else None
        compiled = compile_forward_only(
            b.module, loss_fn, args, kwargs, example_target, held, device, outputs, dynamic=dynamic
        )
        to_rank, microbatches, state = schedule.stage_to_rank, b.options.microbatches, b.ownership.state()
        if not b.distributed:
            return ForwardRunner(compiled, to_rank, microbatches, range(len(stages)), state, InProcessTransport(), None)
        layout = b.layout()
        mine = [s for s, rank in enumerate(to_rank) if rank == layout.pp_rank]
        position = (layout.pp_rank, lambda stage, microbatch: layout.pipeline_ranks[to_rank[stage]])
        return ForwardRunner(
            compiled, to_rank, microbatches, mine, state, train.runner.transport, train.runner.device, position
        )

    def loss_reduction(
        self, runner: ForwardRunner, micro_inputs: list, feeds: list, targets: list
    ) -> batch_loss.LossReduction:
        """How this batch's microbatch losses make its loss (`batch_loss.reduction`), `runner`
        running its stages here."""
        b, compiled = self.builder, runner.compiled
        layout = b.layout() if b.distributed else None
        return batch_loss.reduction(
            compiled.traced, micro_inputs, feeds, targets, b.module, runner.executors, len(compiled.programs), layout
        )


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
