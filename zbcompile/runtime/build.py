"""What one compile of a pipelined module builds, kept together in one record (`Build`): the
compiled stages, the runner following the schedule (solved on one rank and broadcast), the cost
tuner and the dump. `Builder` builds them for a module under its options, and keeps where this
process stands: its layout among the pipelines, the parameters and buffers it holds, and those
materialised from `meta` that nothing filled yet."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zbcompile import auto_recompute
from zbcompile.compiler import CompiledPipeline, compile_forward_only, compile_pipeline
from zbcompile.inspect.write import CompileDump, start_dump
from zbcompile.passes.graph_cost import FLOPS_PER_BYTE
from zbcompile.runtime import batch, batch_loss, grad_reduction, placement, profile, sharding
from zbcompile.runtime.distributed import DistributedRunner, Layout, make_layout
from zbcompile.runtime.forward_only import ForwardRunner
from zbcompile.runtime.local import InProcessTransport, LocalRunner
from zbcompile.runtime.p2p import device_for
from zbcompile.runtime.runner import Runner
from zbcompile.schedules import Costs, Schedule, make_schedule, pipeline_ranks, schedule_label, schedule_spec
from zbcompile.schedules.costs import ResolvedCosts, resolve_costs, with_reduction
from zbcompile.schedules.memory_limit import (
    DEFAULT_LIMIT_RULE,
    default_limit,
    in_schedule_units,
    is_bytes,
    limit_in_words,
)
from zbcompile.schedules.v_choice import PLACEMENTS
from zbcompile.stage_compiler import compile_stage_programs
from zbcompile.value_names import buffer_name, param_name


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
        switches schedules, run the new one from the next step on. Returns the costs of the
        latest schedule solved with measured ones (`measured`, unless it switched)."""
        if self.dump is not None:
            self.dump.record_step(self.runner, measured)
        if self.tuner is not None:
            schedule = self.tuner.after_step(self.runner)
            if schedule is not None:
                self.runner.reschedule(schedule)
                return self.tuner.measured
        return measured


class Builder:
    """Builds and keeps the compiles of `module` under `options` (`api.PipelineOptions`), one
    per batch shape (`prepare`). `held`: the FQNs this rank holds once a distributed compile
    placed them (None before, and in one process); `unfilled`: the tensors materialised from
    `meta` that neither `init_fn` nor a state dict filled yet."""

    def __init__(self, module: nn.Module, options: Any) -> None:
        self.module = module
        self.options = options
        self.held: set[str] | None = None
        self.unfilled: set[str] = set()
        self.builds: dict[Any, Build] = {}  # by compile key (`batch.split`)
        self.forward_builds: dict[Any, ForwardRunner] = {}  # evaluation's, by compile key, results and placement
        self.latest_forward: ForwardRunner | None = None
        self._last_key: Any = None
        self._batch = batch.LocalBatch()
        self._layout: Layout | None = None

    @property
    def distributed(self) -> bool:
        return self.options.process_group is not None or (dist.is_available() and dist.is_initialized())

    def layout(self) -> Layout:
        """This rank's place among the pipelines (made on the first call: a collective of the
        ranks of `process_group`, the world by default)."""
        if self._layout is None:
            o = self.options
            pp_size = pipeline_ranks(o.schedule, o.stages)
            self._layout = make_layout(pp_size, self.device(), f"schedule {schedule_label(o.schedule)} with stages={o.stages}", o.process_group)
        return self._layout

    def device(self) -> torch.device:
        group = self.options.process_group
        return device_for(group.get_group("pp") if isinstance(group, DeviceMesh) else group)

    def prepare(self, inputs: tuple, kwargs: dict, target: Any) -> tuple[Build, list, list, tuple[str, ...]]:
        """The compile for this batch (built if its shapes are new), its microbatches and
        targets, and the parts of the batch this rank was not given (`batch.LocalBatch`)."""
        absent: tuple[str, ...] = ()
        if self.distributed:
            inputs, kwargs, target, absent = self._batch.of(inputs, kwargs, target, self.layout().pp_group, self.device())
        micro_inputs, micro_targets, key = batch.split(inputs, kwargs, target, self.options.microbatches)
        micro_inputs = batch_loss.with_item_count(self.module, self.options.loss_fn, micro_inputs)
        if key not in self.builds:
            self.builds[key] = self.build(micro_inputs[0], micro_targets[0])
        self._last_key = key
        self._set_grad_dtype()
        return self.builds[key], micro_inputs, micro_targets, absent

    def prepare_forward(self, inputs: tuple, kwargs: dict, target: Any, outputs: bool) -> tuple[ForwardRunner, list, list, tuple[str, ...]]:
        """As `prepare`, for evaluation in the module's current mode: the forward-only runner for
        this batch (its loss, or with `outputs` the model's outputs), compiled where the latest
        training compile placed the stages."""
        train = self.latest()
        absent: tuple[str, ...] = ()
        if self.distributed:
            inputs, kwargs, target, absent = self._batch.of(inputs, kwargs, target, self.layout().pp_group, self.device())
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
            return ForwardRunner(compiled, stage_to_rank, microbatches, range(len(stages)), self.state(), InProcessTransport(), None)
        runner, layout = train.runner, self.layout()
        mine = [s for s, rank in enumerate(schedule.stage_to_rank) if rank == layout.pp_rank]
        position = (layout.pp_rank, lambda stage, microbatch: layout.pipeline_ranks[schedule.stage_to_rank[stage]])
        return ForwardRunner(compiled, schedule.stage_to_rank, microbatches, mine, self.state(), runner.transport, runner.device, position)

    def loss_reduction(self, traced: Any, micro_inputs: list, feeds: list, targets: list, held: Any, stages: int) -> batch_loss.LossReduction:
        """How this step's microbatch losses make its loss (`batch_loss.reduction`); `held`: the
        stages this process runs."""
        layout = self.layout() if self.distributed else None
        replicas, group = (layout.dp_size, layout.dp_group) if layout is not None else (1, None)
        holds = (0 in held, stages - 1 in held)
        return batch_loss.reduction(traced, micro_inputs, feeds, targets, self.module, holds, replicas, group)

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
        self.options = replace(self.options, schedule=schedule, memory_limit=memory_limit)
        for key, built in list(self.builds.items()):
            new = self.schedule(built.compiled)
            if new.stages != len(built.compiled.programs):
                raise ValueError(
                    f"schedule {schedule_label(schedule)} runs {new.stages} stages, but this pipeline was compiled in "
                    f"{len(built.compiled.programs)} (zb-auto chose a V of two chunks per rank under its memory_limit); "
                    "build a new pipeline for it"
                )
            built.runner.reschedule(new)
            self.builds[key] = replace(built, tuner=self.tuner(built.compiled))

    def build(self, example: tuple, example_target: Any) -> Build:
        """Compile for microbatches like `example` ((args, kwargs)) and `example_target`, in the
        placement zb-auto chooses (`_placed`)."""
        o = self.options
        compiled, schedule = self._placed(self._compile(example, example_target, o.stages), example, example_target)
        compiled = compile_stage_programs(compiled, o.compiler)
        device = self.device() if self.distributed else None
        if self.distributed:
            runner = self._distributed_runner(compiled, schedule, device)
        else:
            self._place(set(placement.canonical_names(self.module).values()), batch.device_of((example, example_target)), move_others=False)
            runner = LocalRunner(compiled, schedule, self.state())
        tuner = self.tuner(compiled)
        return Build(runner, tuner, start_dump(o.dump_dir, compiled, schedule, o, runner))

    def _placed(self, compiled: CompiledPipeline, example: tuple, example_target: Any) -> tuple[CompiledPipeline, Schedule]:
        """`compiled` (one stage per rank) and its schedule; or, where zb-auto predicts a V of two
        chunks per rank faster by its objective with each chunk estimated as half a stage (or the
        V alone fits the memory limit), the model compiled again in twice the stages, its memory
        still counted in the first compile's unit, with the V solved on the chunks' own costs, if
        it is still faster than one stage per rank. recompute="auto" and split points keep one
        stage per rank; so does a model that does not cut into twice the stages."""
        o = self.options
        offer_v = o.recompute != "auto" and o.split_points is None
        schedule = self.schedule(compiled, PLACEMENTS if offer_v else ("in-line",))
        if schedule.stages == len(compiled.programs):
            return compiled, schedule
        in_line_value = schedule.info.get("in_line_value")  # None: no schedule of one stage per rank fits
        try:
            chunks = self._compile(example, example_target, schedule.stages, memory_unit_bytes=compiled.memory_unit())
            v_schedule = self.schedule(chunks)
        except ValueError as error:
            if in_line_value is not None:  # the model does not cut into 2p chunks, or they do not fit
                return compiled, self.schedule(compiled)
            raise ValueError(
                f"zb-auto chose a V of {schedule.stages} chunks under memory_limit {o.memory_limit!r} with each chunk "
                f"estimated as half a stage, but the chunks as compiled do not fit it ({error}); raise the limit"
            ) from error
        if in_line_value is not None and v_schedule.info["value"] >= in_line_value:
            return compiled, self.schedule(compiled).with_info(v_value=v_schedule.info["value"])
        return chunks, v_schedule.with_info(in_line_value=in_line_value)

    def _compile(self, example: tuple, example_target: Any, stages: int, memory_unit_bytes: int | None = None) -> CompiledPipeline:
        """The model cut into `stages` stages (recompute="auto" applied), before the stage
        programs are compiled; memory counted in units of `memory_unit_bytes` where given."""
        args, kwargs = example
        o = self.options
        device = self.device() if self.distributed else None
        compiled = compile_pipeline(
            self.module, o.loss_fn, args, kwargs, example_target, stages, o.split_points, device,
            recompute_alternatives=o.recompute == "auto",
        )
        if memory_unit_bytes is not None:
            compiled = replace(compiled, memory_unit_bytes=memory_unit_bytes)
        if o.recompute == "auto":
            compiled = self._fit_memory_by_recomputing(compiled)
        return compiled

    def schedule(self, compiled: CompiledPipeline, placements: tuple[str, ...] = ("in-line",)) -> Schedule:
        """The schedule, solved on one rank and broadcast so that every rank runs the same one;
        zb-auto may choose among `placements` (`v_choice.PLACEMENTS`)."""

        def solve() -> Schedule:
            given = self.options.costs
            try:
                costs = static_costs(compiled) if given is None else self._per_compiled_stage(given, compiled)
                arguments = self.solve_arguments(costs, compiled, placements)
                schedule = make_schedule(**arguments)
            except ValueError as error:
                if not is_bytes(self.options.memory_limit):
                    raise
                raise ValueError(f"{limit_in_words(self.options.memory_limit, compiled.memory_unit())}: {error}") from error
            limit = arguments["memory_limit"]
            reduction = with_reduction(costs, self.reduction_per_message(compiled)).reduce  # as solve_arguments counts it
            return schedule.with_info(
                **({"cost_source": "given", "costs": given} if given is not None else {"cost_source": "static"}),
                **({"reduction": tuple(reduction)} if not isinstance(reduction, (int, float)) and any(reduction) else {}),
                **({"memory_limit": limit, "memory_limit_rule": self._limit_rule()} if limit is not None else {}),
            )

        return self._on_first_rank(solve)

    def _fit_memory_by_recomputing(self, compiled: CompiledPipeline) -> CompiledPipeline:
        """recompute="auto": `compiled` at the recompute levels under which the schedule fits the
        memory limit in the least time (`auto_recompute`), chosen on one rank and broadcast
        (zb-auto's solver may differ per rank). A limit in bytes is read in `compiled`'s memory
        unit, the largest stage's M_B before recomputation, which the chosen levels keep."""

        def choose() -> tuple[int, ...]:
            evaluate = functools.partial(auto_recompute.evaluate_memory, solve_arguments=self.solve_arguments)
            return auto_recompute.choose_recomputation(compiled, evaluate).recompute_levels

        return auto_recompute.with_levels(compiled, self._on_first_rank(choose))

    def _on_first_rank(self, make: Callable[[], Any]) -> Any:
        """`make()` on the pipeline's first rank (in one process: here), broadcast to the others."""
        layout = self.layout() if self.distributed else None
        value = make() if layout is None or layout.pp_rank == 0 else None
        if layout is not None and layout.pp_group is not None:
            box = [value]
            dist.broadcast_object_list(box, group=layout.pp_group, group_src=0)
            value = box[0]
        return value

    def solve_arguments(self, costs: Costs, compiled: CompiledPipeline, placements: tuple[str, ...] = ("in-line",)) -> dict[str, Any]:
        """`make_schedule`'s arguments for this pipeline's schedule under `costs` (a limit in bytes
        in `compiled`'s memory unit; `costs` per compiled stage). A compile in twice the
        schedule's stages is zb-auto's V: the schedule is solved in the V again, on its chunks'
        costs. Without a limit, `memory_limit.default_limit`'s rule on the costs solved with."""
        o = self.options
        limit = in_schedule_units(o.memory_limit, compiled.memory_unit())
        costs = with_reduction(costs, self.reduction_per_message(compiled))
        arguments = dict(
            name=o.schedule, stages=o.stages, microbatches=o.microbatches, costs=costs, memory_limit=limit,
            time_budget=o.solver_time_budget, objective=o.objective, placements=placements,
        )
        if isinstance(o.schedule, Schedule):  # run as given: checked against the compiled stages
            arguments["stages"] = len(compiled.programs)
        elif "v" in placements and o.costs is None:  # on the compiler's costs, zb-auto weighs the V by time
            arguments["v_always"] = True
        if self._is_v_compile(compiled) and not isinstance(o.schedule, Schedule):
            chunks = resolve_costs(costs, len(compiled.programs))
            arguments.update(costs=chunks.merged(2), chunk_costs=chunks, placements=("v",))
        if limit is None:
            arguments["memory_limit"] = default_limit(o.schedule, o.stages, o.microbatches, arguments["costs"], compiled.checkpointed())
        return arguments

    def reduction_per_message(self, compiled: CompiledPipeline) -> tuple[float, ...]:
        """Per compiled stage, its gradient reduction over the replicas in boundary messages
        (`grad_reduction.reduction_per_message`): what the schedule counts after its last W."""
        replicas = self.layout().dp_size if self.distributed else 1
        return grad_reduction.reduction_per_message(compiled, replicas, self.options.data_parallel, self.options.grad_dtype)

    def _is_v_compile(self, compiled: CompiledPipeline) -> bool:
        """Whether `compiled` is zb-auto's V: twice the stages the pipeline was given."""
        return len(compiled.programs) != self.options.stages

    def _per_compiled_stage(self, given: Costs, compiled: CompiledPipeline) -> Costs | ResolvedCosts:
        """`pipeline(costs=...)`, given per stage, for `compiled`'s stages: cut in two for a V."""
        return resolve_costs(given, self.options.stages).chunked(2) if self._is_v_compile(compiled) else given

    def _limit_rule(self) -> str:
        return "given" if self.options.memory_limit is not None else DEFAULT_LIMIT_RULE

    def tuner(self, compiled: CompiledPipeline) -> profile.CostTuner | None:
        """Measured costs for a distributed pipeline, where `profile` asks for them (None: where
        the schedule table says the schedule measures them, without given costs)."""
        wanted = self.options.profile
        if wanted is None:
            given = isinstance(self.options.schedule, Schedule)  # nothing to re-solve
            wanted = not given and schedule_spec(self.options.schedule).measures_costs and self.options.costs is None
        if not wanted or not self.distributed:
            return None
        solve_arguments = functools.partial(self.solve_arguments, compiled=compiled)
        recompute = None
        if self.options.recompute == "auto":
            finish = functools.partial(compile_stage_programs, compiler=self.options.compiler)
            recompute = auto_recompute.MeasuredRecomputation(compiled, self.solve_arguments, finish)
        return profile.CostTuner(self.options.profile_steps, solve_arguments, compiled.schedule_costs(), recompute)

    def state(self) -> dict[str, torch.Tensor]:
        """The module's current parameters and buffers, as the runtime names them."""
        state = {param_name(n): p for n, p in self.module.named_parameters()}
        state.update({buffer_name(n): b for n, b in self.module.named_buffers()})
        return state

    def _set_grad_dtype(self) -> None:
        """Give every floating-point parameter the `grad_dtype` option (torch's attribute), so
        that `.grad` accumulates and is held in it."""
        dtype = self.options.grad_dtype
        if dtype is None:
            return
        for param in self.module.parameters():
            if param.is_floating_point() and param.grad_dtype != dtype:
                grad, param.grad = param.grad, None
                param.grad_dtype = dtype
                param.grad = None if grad is None else grad.to(dtype)

    def check_filled(self) -> None:
        """Refuse to compute with parameters or buffers materialised from `meta` but never filled."""
        if not self.unfilled:
            return
        names = sorted(self.unfilled)
        owners = sorted({type(self.module.get_submodule(n.rpartition(".")[0])).__name__ for n in names})
        in_state_dict = set(placement.canonical_names(self.module)) & set(self.module.state_dict(keep_vars=True))
        unloadable = [n for n in names if n not in in_state_dict]
        raise ValueError(
            f"{len(names)} parameters or buffers this process uses were built on the meta device and neither "
            f"initialised nor loaded, e.g. {names[:4]} (owned by {', '.join(owners[:4])}). Pass init_fn= to "
            "pipeline(): a function that fills one module's own parameters and buffers, such as a transformers "
            "model's _init_weights (without it, a module's reset_parameters() fills its parameters and the buffers "
            "it writes)"
            + ("; or load them with pipe.load_state_dict(state_dict) after compile()" if len(unloadable) < len(names) else "")
            + (f". No state dict holds {unloadable[:4]} (non-persistent buffers): only init_fn can fill them" if unloadable else "")
        )

    def held_only(self, named: Iterator[tuple[str, Any]], prefix: str) -> Iterator[tuple[str, Any]]:
        """The (name, tensor) of `named` (a module's `named_parameters(prefix)` or buffers) this
        rank holds: all of them in one process."""
        held = self._held_names()
        for name, tensor in named:
            if held is None or name.removeprefix(prefix + "." if prefix else "") in held:
                yield name, tensor

    def owned_only(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of the module's `state_dict` this rank reports (every alias of a tied
        weight included): all of them in one process; together over all ranks, the model's."""
        if not self.distributed:
            return state_dict
        self._require_placed()
        built = self.latest()
        owned = placement.owned_names(built.compiled, built.runner.schedule, built.runner.layout.pp_rank)
        aliases = placement.canonical_names(self.module)
        return {k: v for k, v in state_dict.items() if aliases.get(k, k) in owned}

    def held_only_entries(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of the module's `state_dict` whose tensors this process holds (every alias
        of a tied weight on every rank that uses it): all of them in one process, or before a
        distributed compile placed the parameters."""
        if self.held is None:
            return state_dict
        aliases = placement.canonical_names(self.module)
        return {k: v for k, v in state_dict.items() if aliases.get(k, k) in self.held}

    def _held_names(self) -> set[str] | None:
        """FQNs this rank holds (None: all of them, in one process)."""
        if not self.distributed:
            return None
        self._require_placed()
        return self.held

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool) -> Any:
        """Copy into the parameters and buffers this process holds their entries of `state_dict`
        (a full state dict, or any holding them; other ranks' entries are skipped), materialising
        those still on the `meta` device. With `strict`, a missing entry this process uses, or
        one the model does not have, raises. In a distributed run with a model on `meta`, call
        it after compiling (which decides what each rank holds)."""
        if self.held is None and self.distributed:  # every rank holds the whole model until compiled
            if any(t.is_meta for t in placement.state_tensors(self.module).values()):
                self._require_placed()
            return self.module.load_state_dict(state_dict, strict=strict)
        held = self.held if self.held is not None else set(placement.canonical_names(self.module).values())
        if self.options.data_parallel == "shard":
            state_dict = sharding.as_shards(state_dict, self.module)
        result, loaded = placement.load_held(self.module, state_dict, held, strict)
        self.unfilled -= loaded
        return result

    def _require_placed(self) -> None:
        if self.held is None:
            raise RuntimeError(
                "in a distributed run each rank holds only its stages' parameters, which are known after "
                "compiling: call pipe.compile(batch, target=...) (or step()) before parameters(), state_dict(), "
                "load_state_dict() of a model on the meta device, or building the optimizer"
            )

    def _distributed_runner(self, compiled: CompiledPipeline, schedule: Schedule, device: torch.device) -> DistributedRunner:
        layout = self.layout()
        if schedule.ranks != layout.pp_size:
            raise ValueError(
                f"schedule {schedule_label(schedule)} runs on {schedule.ranks} ranks per pipeline, but this pipeline was laid "
                f"out for {layout.pp_size}; build a new pipeline for it"
            )
        local_stages = schedule.stages_on(layout.pp_rank)
        used = {f for s in local_stages for f in (*compiled.partition.stages[s].param_fqns, *compiled.partition.stages[s].buffer_fqns)}

        def runner() -> DistributedRunner:
            o = self.options
            return DistributedRunner(compiled, schedule, layout, self.state(), device, o.timeout, o.follow_readiness, o.data_parallel)

        if self.held is not None:
            if used - self.held:
                raise ValueError(
                    f"these batch shapes cut the model differently from the first compile, and this rank does not "
                    f"hold {sorted(used - self.held)[:4]}; pass split_points=[...] to pipeline() to fix the cut"
                )
            return runner()
        self._check_shardable(layout)
        # the runner shares tied weights' values between ranks: after placement, undone if it fails
        built = self._place(used, device, move_others=True, then=runner)
        if self.options.data_parallel == "shard":  # the replicas' values are equal now: each keeps its shard
            sharding.shard_parameters(self.module, self.held, layout.mesh["dp"])
        return built

    def _check_shardable(self, layout: Layout) -> None:
        """data_parallel="shard" needs replicas on a DeviceMesh with a "dp" dimension, and every
        parameter a leading dimension (checked on every rank, before any rank places its own)."""
        if self.options.data_parallel != "shard":
            return
        for name, param in self.module.named_parameters():
            sharding.check_shardable(name, param)
        if layout.dp_size < 2 or layout.mesh is None:
            raise ValueError(
                f"data_parallel='shard' shards parameters over data-parallel replicas, but this pipeline has "
                f"{layout.dp_size} replica{'s' if layout.dp_size > 1 else ''}"
                f"{'' if layout.mesh is not None else ' and no DeviceMesh'}; launch a multiple of {layout.pp_size} "
                "processes (the default ('dp', 'pp') mesh) or pass process_group=<DeviceMesh with 'dp' and 'pp'>, "
                "or use data_parallel='replicate'"
            )

    def _place(self, held: set[str], device: torch.device, move_others: bool, then: Callable[[], Any] = lambda: None) -> Any:
        """Materialise and fill what this process holds (`placement.placed`), then run `then()`;
        if either raises, the module keeps the tensors it had."""
        with placement.placed(self.module, held, device, self.options.init_fn, move_others) as unfilled:
            result = then()
        self.unfilled |= unfilled
        if move_others:
            self.held = set(held)
        return result


def static_costs(compiled: CompiledPipeline) -> Costs:
    """The compiler's estimates (`CompiledPipeline.schedule_costs`) with a message's time: the
    largest boundary's bytes, written once by the sender and once by the receiver, in the same
    FLOP-equivalents (`graph_cost.FLOPS_PER_BYTE`), so that the V's extra messages count."""
    costs = compiled.schedule_costs()
    largest = max(compiled.partition.boundary_bytes, default=0)
    return replace(costs, comm=2 * FLOPS_PER_BYTE * largest)
