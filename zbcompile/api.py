"""`zbcompile.pipeline()`: wrap a model (or decorate its class) so that `step()` runs one
pipelined forward + backward over all microbatches. Compilation happens on the first step and
again whenever a step's microbatch shapes, dtypes or constant arguments differ."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zbcompile._torch_internals import pytree
from zbcompile.compiler import CompiledPipeline, compile_pipeline
from zbcompile.inspect.text import summary_text
from zbcompile.inspect.write import CompileDump, live_dump, start_dump
from zbcompile.runtime import batch_agreement, placement, profile
from zbcompile.runtime.batch_agreement import BatchDescription
from zbcompile.runtime.distributed import DistributedRunner, Layout, make_layout
from zbcompile.runtime.local import LocalRunner
from zbcompile.runtime.p2p import device_for
from zbcompile.runtime.runner import Runner
from zbcompile.runtime.stage import StageExecutor
from zbcompile.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, Costs, Schedule, make_schedule, schedule_spec
from zbcompile.stage_compiler import check_compiler, compile_stage_programs
from zbcompile.value_names import buffer_name, param_name

DEFAULT_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class PipelineOptions:
    stages: int
    microbatches: int
    loss_fn: Callable[..., torch.Tensor] | None = None
    schedule: str = DEFAULT_SCHEDULE
    split_points: tuple[str, ...] | None = None
    memory_limit: float | Sequence[float] | None = None
    process_group: Any = None
    timeout: timedelta = DEFAULT_TIMEOUT
    solver_time_budget: float | None = None
    profile: bool | None = None
    profile_steps: int = 2
    objective: str = "span"
    compiler: str | None = None
    dump_dir: str | None = None
    init_fn: Callable[[nn.Module], None] | None = None
    costs: Costs | None = None
    follow_readiness: bool = True

    def __post_init__(self) -> None:
        check_compiler(self.compiler)
        if self.profile not in (None, True, False):
            raise ValueError(f"pipeline(): profile must be None (automatic), True or False, got {self.profile!r}")
        if self.costs is not None and not isinstance(self.costs, Costs):
            raise TypeError(f"pipeline(): costs must be a zbcompile.schedules.Costs, got {type(self.costs).__name__}")
        for name in ("stages", "microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pipeline(): {name} must be a positive int, got {value!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"pipeline(): unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def pipeline(
    model: nn.Module | type | None = None,
    *,
    stages: int,
    microbatches: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    split_points: Sequence[str] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    process_group: Any = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    solver_time_budget: float | None = None,
    profile: bool | None = None,
    profile_steps: int = 2,
    objective: str = "span",
    compiler: str | None = None,
    dump_dir: str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    costs: Costs | None = None,
    follow_readiness: bool = True,
):
    """Make `model` a pipelined model: `pipeline(model, stages=4, microbatches=8, loss_fn=F.mse_loss)`.

    Also a class decorator: `@pipeline(stages=4, ...)` on an `nn.Module` subclass makes its
    constructor return a `PipelinedModule` around the new instance.
    `loss_fn(output, target)` must return the mean loss of a microbatch; without one, the
    model's forward must return that loss itself. `split_points` are module FQNs where a new
    stage begins (otherwise the stages are balanced by cost). `memory_limit` bounds each stage's
    activation memory in units of one microbatch's activations (zb-auto, zbv);
    `solver_time_budget` caps the seconds zb-auto spends improving its heuristic; `objective`
    is what it minimises: "span" (steps run back to back, the default) or "makespan" (every
    step ends in a synchronisation, e.g. global gradient clipping without post-validation).
    `costs` (a `zbcompile.schedules.Costs`, times in any one unit) replace the compiler's
    static estimates for solving the schedule.

    Measured costs (`profile`): a distributed pipeline first runs the schedule solved from
    static FLOP estimates (or `costs`) while every action is timed; after the first (warm-up)
    step and `profile_steps` more, the costs measured on every rank (and the time to send a
    boundary message) are gathered, rank 0 solves the schedule with them in a child process
    while the steps go on, and every rank switches to it after the step in which it was ready.
    It then re-solves when the measured step time drifts from the prediction
    (`runtime/profile.py`).
    `profile=None` (the default) does this for zb-auto without `costs`; True for any schedule;
    False never. `follow_readiness` (default True): a rank whose next computation waits for a
    message runs its next weight-gradient work (W) meanwhile, and W that the schedule puts just
    before a send run after it where memory allows; W keep their order, so gradients are the
    same bits either way (`runtime/distributed.py`).

    Under torch.distributed (an initialised default group), each rank runs its own stage(s) (see
    `PipelinedModule`); `timeout` (seconds) bounds every wait on a peer. The pipelines span the
    world by default; `process_group=` confines them to a process group of one pipeline's ranks
    or to a DeviceMesh with a "pp" and optionally a "dp" dimension (e.g. `mesh["dp", "pp"]` of a
    larger mesh).

    `compiler="inductor"` compiles each stage's F, I and W graphs with Inductor on their first
    run; the default (None or "eager") runs them op by op (see `zbcompile.stage_compiler`).
    `dump_dir` (default: `$ZBCOMPILE_DUMP`) receives graphs, tables, the schedule and the measured
    trace of every compile (`zbcompile.inspect.write`; read them with `zbcompile inspect DIR`).

    A model built on the `meta` device gets the parameters and buffers this process's stages
    use materialised when it compiles; `init_fn(module)` (e.g. a transformers model's
    `_init_weights`) is then called, under `torch.no_grad()`, on each module owning one of them
    and must fill that module's own parameters and buffers; without it, a module's
    `reset_parameters()` fills its parameters and the buffers it writes (BatchNorm's statistics).
    What neither fills must come from `load_state_dict()` before the first step (see
    `PipelinedModule`).
    """
    options = PipelineOptions(
        stages,
        microbatches,
        loss_fn,
        schedule,
        tuple(split_points) if split_points is not None else None,
        memory_limit,
        process_group,
        timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
        solver_time_budget,
        profile,
        profile_steps,
        objective,
        compiler=compiler,
        dump_dir=dump_dir,
        init_fn=init_fn,
        costs=costs,
        follow_readiness=follow_readiness,
    )
    if model is None:
        return functools.partial(_wrap, options=options)
    return _wrap(model, options)


def _wrap(model: nn.Module | type, options: PipelineOptions):
    if isinstance(model, type) and issubclass(model, nn.Module):

        @functools.wraps(model, updated=())
        def construct(*args: Any, **kwargs: Any) -> PipelinedModule:
            return PipelinedModule(model(*args, **kwargs), options)

        return construct
    if not isinstance(model, nn.Module):
        raise TypeError(f"pipeline() takes an nn.Module or an nn.Module subclass, got {type(model).__name__}")
    return PipelinedModule(model, options)


@dataclass(frozen=True)
class _Compiled:
    compiled: CompiledPipeline
    schedule: Schedule
    runner: Runner
    tuner: profile.CostTuner | None = None  # measured costs (distributed)


class PipelinedModule:
    """A model trained with a pipeline schedule. Calling the object runs the unpipelined forward.

    In one process, parameters, buffers and `state_dict()` are the wrapped module's own (same
    objects, same FQNs), so optimizers built on `parameters()` work.

    Under torch.distributed, `world_size = ranks per pipeline x k` runs k data-parallel replicas
    (replica d takes the d-th slice of the batch). Every rank calls `step()` with the full batch;
    only the first stage's rank reads the inputs and only the last stage's rank the target, so
    other ranks may pass None for them (`pipe.step(None, target=None)`; they then follow the
    shapes of the latest compile, so pass the batch on every rank when its shapes change). The
    rank holding the last stage gets the replica's loss, the others None; besides the schedule's
    messages, only a compile (first step, new shapes) makes ranks wait for each other. Each rank keeps only the parameters its stages use; the others move to
    the `meta` device. So build the optimizer after `compile(batch)`: `parameters()` then yields
    the parameters this rank holds (a tied weight on each rank using it; its gradient is summed
    between them, so the copies stay equal), and `state_dict()` this rank's share (a tied weight
    from the rank of its first stage): gathering every rank's `state_dict()` gives the model's.

    A model built on the `meta` device: compiling materialises the parameters and buffers this
    process uses and fills them with `init_fn` or `reset_parameters()` (see `pipeline()`);
    `load_state_dict(state_dict)` copies this process's entries from a full state dict (or any
    holding them), ignoring the other ranks' entries; in one process it may also come before
    the first compile. A step refuses to run while a parameter or buffer it uses was filled by
    neither.
    """

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        self.module = module
        self.options = options
        self._compiled: dict[Any, _Compiled] = {}
        self._last_key: Any = None
        self._local: set[str] | None = None  # FQNs this rank holds, once compiled (distributed)
        self._unfilled: set[str] = set()  # materialised from `meta`, filled by neither init nor load_state_dict
        self._dumps: dict[Any, CompileDump | None] = {}
        self.measured_costs: Costs | None = None  # the costs of the latest schedule solved with measured ones
        self._layout: Layout | None = None  # this rank's place (distributed), once known
        self._agreed: list[BatchDescription] = []  # batches the ranks agreed on (distributed), latest last
        self._placeholder_cache: dict[str, tuple[batch_agreement.Part, Any]] = {}
        # run at the start of every step(), before this rank's first forward (optimizer
        # post-validation finishes the previous optimizer step there), and before state_dict()
        self.pre_step_hooks: list[Callable[[], None]] = []
        self.state_dict_hooks: list[Callable[[], None]] = []

    @property
    def distributed(self) -> bool:
        return self.options.process_group is not None or (dist.is_available() and dist.is_initialized())

    # --- training --------------------------------------------------------------------------

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One pipelined forward + backward over the batch: splits every tensor in `inputs`,
        `kwargs` and `target` into `microbatches` equal parts along dim 0, runs the schedule,
        accumulates the gradient of the mean microbatch loss into each parameter's `.grad`, and
        returns that mean loss (None on ranks without the last stage)."""
        inputs, kwargs, target, absent = self._local_batch(inputs, kwargs, target)
        micro_inputs, micro_targets, key = self._split(inputs, kwargs, target)
        bundle = self._compile(key, micro_inputs[0], micro_targets[0])
        self._check_given(bundle, absent)
        self._check_filled()
        bundle.runner.set_state(self._state())  # the module's current tensors, even if reassigned
        feeds = [self._feed(bundle.compiled, args, kw, tgt) for (args, kw), tgt in zip(micro_inputs, micro_targets)]
        for hook in self.pre_step_hooks:
            hook()
        losses = bundle.runner.step([f[0] for f in feeds], [f[1] for f in feeds])
        if self._dumps.get(key) is not None:
            self._dumps[key].record_step(bundle.runner, self.measured_costs)
        self._accumulate_grads(bundle.runner.reduce_grads())
        if bundle.tuner is not None:
            schedule = bundle.tuner.after_step(bundle.runner)
            if schedule is not None:
                bundle.runner.reschedule(schedule)
                self._compiled[key] = dataclasses.replace(bundle, schedule=schedule)
                self.measured_costs = bundle.tuner.measured
        return torch.stack(losses).mean().detach() if losses is not None else None

    def compile(self, *inputs: Any, target: Any = None, **kwargs: Any) -> "PipelinedModule":
        """Compile for batches shaped like this one without running a step (in a distributed run,
        do this before building the optimizer)."""
        inputs, kwargs, target, _ = self._local_batch(inputs, kwargs, target)
        micro_inputs, micro_targets, key = self._split(inputs, kwargs, target)
        self._compile(key, micro_inputs[0], micro_targets[0])
        return self

    def set_schedule(self, schedule: str, memory_limit: float | Sequence[float] | None = None) -> "PipelinedModule":
        """Run `schedule` from the next step on, without recompiling. In a distributed run the new
        schedule must keep every stage on its rank (e.g. any two single-chunk schedules)."""
        self.options = dataclasses.replace(self.options, schedule=schedule, memory_limit=memory_limit)
        for key, bundle in list(self._compiled.items()):
            new = self._make_schedule(bundle.compiled)
            bundle.runner.reschedule(new)
            self._compiled[key] = _Compiled(bundle.compiled, new, bundle.runner, self._tuner(bundle.runner, bundle.compiled))
        return self

    def explain(self) -> str:
        """What `zbcompile inspect` prints for the latest compile: stages, balance, costs, the
        schedule's predicted makespan and bubble, and with a dump the measured ones."""
        self._latest()
        return summary_text(live_dump(self, self._dumps.get(self._last_key)))

    @property
    def compiled(self) -> CompiledPipeline:
        """The compiler's result for the latest step's shapes."""
        return self._latest().compiled

    @property
    def schedule(self) -> Schedule:
        return self._latest().schedule

    @property
    def runner(self) -> Runner:
        return self._latest().runner

    @property
    def tuner(self) -> profile.CostTuner | None:
        """What measures the costs of the latest compile and re-solves with them (its `history`
        of decisions); None where costs are not measured."""
        return self._latest().tuner

    @property
    def executors(self) -> list[StageExecutor]:
        return list(self.runner.executors.values())

    def _latest(self) -> _Compiled:
        if self._last_key is None:
            raise RuntimeError("the pipeline compiles on the first step() or compile(); call one of them first")
        return self._compiled[self._last_key]

    def _local_batch(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any, tuple[str, ...]]:
        """The batch this rank computes with, and which parts it was not given ("inputs",
        "target"). In one process: what was passed. Under torch.distributed a rank may pass None
        for the inputs and for the target; it then computes with placeholders shaped like the
        batch the ranks agreed on (see `batch_agreement`), which `_check_given` keeps away from
        the stages that read them."""
        if not self.distributed:
            return args, kwargs, target, ()
        mine = BatchDescription.of(args, kwargs, target)
        agreed = mine.filled_from(self._agreed[-1]) if self._agreed else None
        if agreed not in self._agreed:
            agreed = batch_agreement.agree(mine, self._pipeline_layout().pp_group)
            self._agreed.append(agreed)
        absent = []
        if mine.inputs is None:
            args, kwargs = self._placeholders("inputs", agreed.inputs)
            absent.append("inputs")
        if mine.target is None and agreed.target is not None:
            target = self._placeholders("target", agreed.target)
            absent.append("target")
        return args, kwargs, target, tuple(absent)

    def _placeholders(self, part_name: str, part: batch_agreement.Part) -> Any:
        cached = self._placeholder_cache.get(part_name)
        if cached is None or cached[0] != part:
            cached = (part, part.placeholders(self._device()))
            self._placeholder_cache[part_name] = cached
        return cached[1]

    def _check_given(self, bundle: _Compiled, absent: tuple[str, ...]) -> None:
        """Refuse to run a stage on placeholders: the rank holding the first stage needs the
        inputs, the one holding the last stage the target."""
        if not absent:
            return
        readers = {"inputs": (0, "first"), "target": (bundle.schedule.stages - 1, "last")}
        for part in absent:
            stage, which = readers[part]
            if stage in bundle.runner.executors:
                raise ValueError(
                    f"rank {dist.get_rank()} holds stage {stage}, the {which} stage, which reads the {part}, but "
                    f"step() got None for the {part} here; pass the {part} on this rank"
                )

    def _split(self, inputs: tuple, kwargs: dict, target: Any):
        m = self.options.microbatches
        leaves, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs)))
        target_leaves, target_spec = pytree.tree_flatten(target)
        tensors = [x for x in [*leaves, *target_leaves] if isinstance(x, torch.Tensor)]
        if not tensors:
            raise ValueError("step() needs at least one tensor input to split into microbatches")
        batch = tensors[0].shape[0] if tensors[0].dim() else None
        for x in tensors:
            if x.dim() == 0 or x.shape[0] != batch:
                raise ValueError(
                    f"every tensor passed to step() is split along dim 0 into microbatches, so all need the "
                    f"same batch size; got shapes {[tuple(t.shape) for t in tensors]}. Pass per-model constants "
                    "as buffers of the model instead."
                )
        replicas, replica = self._replica()
        if batch % (m * replicas):
            across = f" across {replicas} data-parallel replicas" if replicas > 1 else ""
            raise ValueError(
                f"the batch of {batch} samples does not split into microbatches={m} equal microbatches{across}; "
                f"use a batch size divisible by {m * replicas}"
            )

        def chunks(values: list) -> list[list]:
            mine = [v.chunk(replicas)[replica] if isinstance(v, torch.Tensor) else v for v in values]
            return [[v.chunk(m)[i] if isinstance(v, torch.Tensor) else v for v in mine] for i in range(m)]

        micro_inputs = [pytree.tree_unflatten(c, spec) for c in chunks(leaves)]
        micro_targets = (
            [pytree.tree_unflatten(c, target_spec) for c in chunks(target_leaves)] if target is not None else [None] * m
        )
        key = (
            spec,
            target_spec,
            tuple(
                (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else _constant_key(t)
                for t in [*leaves, *target_leaves]
            ),
        )
        return micro_inputs, micro_targets, key

    def _replica(self) -> tuple[int, int]:
        """(data-parallel replicas, this rank's replica)."""
        if not self.distributed:
            return 1, 0
        layout = self._pipeline_layout()
        return layout.dp_size, layout.dp_rank

    def _pipeline_layout(self) -> Layout:
        """This rank's place among the pipelines (made on the first call: a collective of the
        ranks of `process_group`, the world by default)."""
        if self._layout is None:
            pp_size = schedule_spec(self.options.schedule).ranks(self.options.stages)
            description = f"schedule {self.options.schedule!r} with stages={self.options.stages}"
            self._layout = make_layout(pp_size, self._device(), description, self.options.process_group)
        return self._layout

    def _device(self) -> torch.device:
        group = self.options.process_group
        return device_for(group.get_group("pp") if isinstance(group, DeviceMesh) else group)

    def _compile(self, key: Any, example: tuple, example_target: Any) -> _Compiled:
        if key not in self._compiled:
            args, kwargs = example
            device = self._device() if self.distributed else None
            compiled = compile_pipeline(
                self.module,
                self.options.loss_fn,
                args,
                kwargs,
                example_target,
                self.options.stages,
                self.options.split_points,
                device,
            )
            compiled = compile_stage_programs(compiled, self.options.compiler)
            schedule = self._make_schedule(compiled)
            if self.distributed:
                runner = self._distributed_runner(compiled, schedule, device)
            else:
                self._place(set(placement.canonical_names(self.module).values()), _device_of((example, example_target)), move_others=False)
                runner = LocalRunner(compiled, schedule, self._state())
            self._compiled[key] = _Compiled(compiled, schedule, runner, self._tuner(runner, compiled))
            self._dumps[key] = start_dump(self.options.dump_dir, compiled, schedule, self.options, runner)
        self._last_key = key
        return self._compiled[key]

    def _make_schedule(self, compiled: CompiledPipeline) -> Schedule:
        """The schedule, solved on one rank and broadcast so that every rank runs the same one."""
        schedule = None
        layout = self._pipeline_layout() if self.distributed else None
        if layout is None or layout.pp_rank == 0:
            given = self.options.costs is not None
            schedule = make_schedule(**self._solve_arguments(self.options.costs or compiled.schedule_costs()))
            schedule = schedule.with_info(**({"cost_source": "given", "costs": self.options.costs} if given else {"cost_source": "static"}))
        if layout is not None and layout.pp_group is not None:
            box = [schedule]
            dist.broadcast_object_list(box, group=layout.pp_group, group_src=0)
            schedule = box[0]
        return schedule

    def _solve_arguments(self, costs: Costs) -> dict[str, Any]:
        """`make_schedule`'s arguments for this pipeline's schedule under `costs`."""
        o = self.options
        return dict(
            name=o.schedule, stages=o.stages, microbatches=o.microbatches, costs=costs, memory_limit=o.memory_limit,
            time_budget=o.solver_time_budget, objective=o.objective,
        )

    def _tuner(self, runner: Runner, compiled: CompiledPipeline) -> profile.CostTuner | None:
        """Measured costs for a distributed runner, where `profile` asks for them (None: for
        zb-auto without given costs)."""
        wanted = self.options.profile
        if wanted is None:
            wanted = schedule_spec(self.options.schedule).measures_costs and self.options.costs is None
        if not wanted or not self.distributed:
            return None
        static = compiled.schedule_costs()
        return profile.CostTuner(self.options.profile_steps, self._solve_arguments, static)

    def _distributed_runner(self, compiled: CompiledPipeline, schedule: Schedule, device: torch.device) -> DistributedRunner:
        layout = self._pipeline_layout()
        if schedule.ranks != layout.pp_size:
            raise ValueError(
                f"schedule {schedule.name!r} runs on {schedule.ranks} ranks per pipeline, but this pipeline was laid "
                f"out for {layout.pp_size}; build a new pipeline for it"
            )
        local_stages = [s for s, r in enumerate(schedule.stage_to_rank) if r == layout.pp_rank]
        used = {f for s in local_stages for f in (*compiled.partition.stages[s].param_fqns, *compiled.partition.stages[s].buffer_fqns)}
        if self._local is not None:
            if used - self._local:
                raise ValueError(
                    f"these batch shapes cut the model differently from the first compile, and this rank does not "
                    f"hold {sorted(used - self._local)[:4]}; pass split_points=[...] to pipeline() to fix the cut"
                )
            return DistributedRunner(compiled, schedule, layout, self._state(), device, self.options.timeout, self.options.follow_readiness)
        # the runner shares tied weights' values between ranks: after placement, undone if it fails
        return self._place(used, device, move_others=True, then=lambda: DistributedRunner(
            compiled, schedule, layout, self._state(), device, self.options.timeout, self.options.follow_readiness
        ))

    def _place(self, held: set[str], device: torch.device, move_others: bool, then: Callable[[], Any] = lambda: None) -> Any:
        """Materialise and fill what this process holds (`placement.placed`), then run `then()`;
        if either raises, the module keeps the tensors it had."""
        with placement.placed(self.module, held, device, self.options.init_fn, move_others) as unfilled:
            result = then()
        self._unfilled |= unfilled
        if move_others:
            self._local = set(held)
        return result

    def _check_filled(self) -> None:
        """Refuse to compute with parameters or buffers materialised from `meta` but never filled."""
        if not self._unfilled:
            return
        names = sorted(self._unfilled)
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

    def _state(self) -> dict[str, torch.Tensor]:
        state = {param_name(n): p for n, p in self.module.named_parameters()}
        state.update({buffer_name(n): b for n, b in self.module.named_buffers()})
        return state

    @staticmethod
    def _feed(compiled: CompiledPipeline, args: tuple, kwargs: dict, target: Any):
        traced = compiled.traced
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        # the graphs were traced on contiguous tensors
        tensors = [x.contiguous() for x in leaves if isinstance(x, torch.Tensor)]
        inputs = {f"input_{i}": t for i, t in enumerate(tensors)}
        # no target leaves without a loss_fn or with a None target (the graph has no target inputs)
        target_tensors = [t.contiguous() for t in pytree.tree_leaves(target)] if traced.target_spec is not None else []
        targets = {f"target_{i}": t for i, t in enumerate(target_tensors)}
        return inputs, targets

    def _accumulate_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add the step's gradients to `.grad`."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                grad = grads.get(name)
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    # --- the wrapped module's interface ----------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's parameters; in a distributed run, the ones this rank holds (a tied weight
        on every rank that uses it, so each rank's optimizer keeps its copy in step)."""
        held = self._held()
        for name, param in self.module.named_parameters(prefix, recurse, remove_duplicate):
            if held is None or name.removeprefix(prefix + "." if prefix else "") in held:
                yield name, param

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return (b for _, b in self.named_buffers(recurse=recurse))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        held = self._held()
        for name, buffer in self.module.named_buffers(prefix, recurse, remove_duplicate):
            if held is None or name.removeprefix(prefix + "." if prefix else "") in held:
                yield name, buffer

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state dict; in a distributed run, the entries this rank owns (every alias
        of a tied weight included), which together over all ranks make the whole model's."""
        for hook in self.state_dict_hooks:
            hook()
        full = self.module.state_dict(*args, **kwargs)
        owned = self._owned()
        if owned is None:
            return full
        aliases = placement.canonical_names(self.module)
        return {k: v for k, v in full.items() if aliases.get(k, k) in owned}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Copy into the parameters and buffers this process holds their entries of `state_dict`
        (a full state dict, or any holding them; other ranks' entries are skipped), materialising
        those still on the `meta` device. With `strict`, a missing entry this process uses, or
        one the model does not have, raises. In a distributed run with a model on `meta`, call
        it after `compile()` (which decides what each rank holds)."""
        if self._local is None and self.distributed:  # every rank holds the whole model until compiled
            if any(t.is_meta for t in placement.state_tensors(self.module).values()):
                self._require_compiled()
            return self.module.load_state_dict(state_dict, strict=strict)
        held = self._local if self._local is not None else set(placement.canonical_names(self.module).values())
        result, loaded = placement.load_held(self.module, state_dict, held, strict)
        self._unfilled -= loaded
        return result

    def _held(self) -> set[str] | None:
        """FQNs this rank holds (None: all of them, in one process)."""
        if not self.distributed:
            return None
        self._require_compiled()
        return self._local

    def _require_compiled(self) -> None:
        if self._local is None:
            raise RuntimeError(
                "in a distributed run each rank holds only its stages' parameters, which are known after "
                "compiling: call pipe.compile(batch, target=...) (or step()) before parameters(), state_dict(), "
                "load_state_dict() of a model on the meta device, or building the optimizer"
            )

    def _owned(self) -> set[str] | None:
        """FQNs whose state-dict entries this rank reports (None: all of them, in one process)."""
        if not self.distributed:
            return None
        self._require_compiled()
        bundle = self._latest()
        return placement.owned_names(bundle.compiled, bundle.schedule, bundle.runner.layout.pp_rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self, mode: bool = True) -> "PipelinedModule":
        self.module.train(mode)
        self._compiled.clear()  # dropout and friends trace differently
        return self

    def eval(self) -> "PipelinedModule":
        return self.train(False)

    def __repr__(self) -> str:
        o = self.options
        return f"PipelinedModule(stages={o.stages}, microbatches={o.microbatches}, schedule={o.schedule!r}, module={self.module!r})"


def _device_of(batch: Any) -> torch.device:
    """Where a one-process pipeline computes: the device of the batch's first tensor."""
    tensors = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _constant_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)
