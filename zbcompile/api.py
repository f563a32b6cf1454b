"""`zbcompile.pipeline()`: wrap a model (or decorate its class) so that `step()` runs one pipelined
forward + backward over all microbatches, compiled again when microbatch shapes, dtypes or constants change."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from zbcompile.compiler import CompiledPipeline
from zbcompile.inspect.decisions_text import tuner_lines
from zbcompile.inspect.text import summary_text
from zbcompile.inspect.write import live_dump
from zbcompile.options import PipelineOptions
from zbcompile.runtime.build import Builder
from zbcompile.runtime.parallel import batch
from zbcompile.runtime.step.forward_only import ForwardRunner
from zbcompile.runtime.step.runner import Runner
from zbcompile.runtime.step.stage import StageExecutor
from zbcompile.runtime.tuning import profile
from zbcompile.schedules import Costs, Schedule, schedule_label

_View = TypeVar("_View", bound="ModuleView")


def pipeline(model: nn.Module | type | None = None, /, **options: Any):
    """Make `model` a pipelined model: `pipeline(model, stages=4, microbatches=8, loss_fn=F.mse_loss)`;
    as a class decorator (`@pipeline(stages=4, ...)` on an `nn.Module` subclass) its constructor
    returns a `PipelinedModule` around the new instance. The options, by keyword: `PipelineOptions`
    (zbcompile/options.py); README.md tells how distributed runs, measured costs (`profile`) and
    models on the `meta` device work."""
    options = PipelineOptions(**options)
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


class ModuleView:
    """The wrapped module's nn.Module interface: its unpipelined forward, and this rank's share of its state."""

    def __init__(self, module: nn.Module, builder: Builder) -> None:
        self.module = module
        self._builder = builder  # the compiles, one per batch shape, and placement
        self._ownership = builder.ownership  # what this process holds
        self.state_dict_hooks: list[Callable[[], None]] = []  # run before every state_dict()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's parameters; in a distributed run, the ones this rank holds (a tied weight
        on every rank that uses it, so each rank's optimizer keeps its copy in step)."""
        return self._ownership.held_only(self.module.named_parameters(prefix, recurse, remove_duplicate), prefix)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return (b for _, b in self.named_buffers(recurse=recurse))

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self._ownership.held_only(self.module.named_buffers(prefix, recurse, remove_duplicate), prefix)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state dict; in a distributed run, the entries this rank owns (every alias
        of a tied weight included), which together over all ranks make the whole model's."""
        for hook in self.state_dict_hooks:
            hook()
        return self._builder.owned_only(self.module.state_dict(*args, **kwargs))

    def held_state_dict(self) -> dict[str, Any]:
        """The module's state-dict entries this process holds (what `load_state_dict` fills here;
        every alias of a tied weight on every rank that uses it): all of them in one process."""
        return self._ownership.held_only_entries(self.module.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Copy this process's entries of any state dict holding them (`StateOwnership.load_state_dict`)."""
        return self._ownership.load_state_dict(state_dict, strict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def train(self: _View, mode: bool = True) -> _View:
        self.module.train(mode)  # a step in another mode compiles again: dropout and friends trace differently
        return self

    def eval(self: _View) -> _View:
        return self.train(False)


class PipelinedModule(ModuleView):
    """A model trained with a pipeline schedule: `step()` runs one. Under torch.distributed (README.md,
    "Many processes") every rank of a pipeline calls `step()` with that pipeline's batch (with data-parallel
    replicas, its replica's own, as with DDP; ranks without the first or last stage may pass None) and keeps
    only its stages' parameters: build the optimizer after `compile(batch)`; `state_dict()` is this rank's share."""

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        super().__init__(module, Builder(module, options))
        # at the start of every step() and evaluate() (optimizer post-validation finishes its last step there)
        self.pre_step_hooks: list[Callable[[], None]] = []
        self.step_count = 0  # steps run (`step()` calls); zbcompile.checkpoint saves and restores it

    @property
    def options(self) -> PipelineOptions:
        return self._builder.options

    @property
    def distributed(self) -> bool:
        return self._builder.distributed

    @property
    def measured_costs(self) -> Costs | None:
        """The costs of the latest schedule solved with measured ones (None before any)."""
        return self._builder.measured_costs

    @measured_costs.setter
    def measured_costs(self, costs: Costs | None) -> None:
        self._builder.measured_costs = costs

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One pipelined forward + backward over the batch: splits every tensor in `inputs`,
        `kwargs` and `target` into `microbatches` equal parts along dim 0, runs the schedule,
        accumulates the gradient of the batch's loss into each parameter's `.grad`, and returns
        that loss (None on ranks without the last stage): the mean of the microbatch losses, or
        the whole batch's sum(loss_sum) / sum(count) (`runtime/parallel/batch_loss.py`). With data-parallel
        replicas, the batch is this replica's own and the gradient every replica accumulates is the
        mean of the replicas' (for a mean loss, that of their batches concatenated); the loss
        returned is this replica's mean, or with (loss_sum, count) the whole batch's over every
        replica."""
        loss = self._builder.step(inputs, kwargs, target, self.pre_step_hooks)
        self.step_count += 1
        return loss

    def evaluate(self, *inputs: Any, target: Any = None, return_outputs: bool = False, **kwargs: Any) -> Any:
        """The batch's loss computed forward only through the pipeline, with every module in eval
        mode for the call (dropout off, BatchNorm reading its running statistics): F of every
        microbatch in a forward-only schedule, nothing kept for a backward, gradients untouched.
        Returns the loss as `step()` makes it, or with `return_outputs` the model's output with
        every tensor concatenated over the microbatches (a 0-dim one, such as a loss the model
        computes, stacked: one per microbatch); None on ranks without the last stage. The stages
        sit where the latest training compile put them (call `compile()` or `step()` first)."""
        for hook in self.pre_step_hooks:  # a post-validated optimizer's last step is final
            hook()
        with _eval_mode(self.module):
            return _forward_pass(self._builder, inputs, kwargs, target, return_outputs)

    def compile(self, *inputs: Any, target: Any = None, **kwargs: Any) -> "PipelinedModule":
        """Compile for batches shaped like this one without a step (distributed: before building the optimizer)."""
        self._builder.prepare(inputs, kwargs, target)
        return self

    def set_schedule(
        self, schedule: str | Schedule, memory_limit: float | str | Sequence[float | str] | None = None
    ) -> "PipelinedModule":
        """Run `schedule` (a name, or a `Schedule` such as `Schedule.from_csv(text)`, checked against the
        compile: stages, microbatches, placement) from the next step on, without recompiling (distributed: every
        stage must stay on its rank). recompute="auto" keeps the recomputation chosen at compile, and its limit
        unless one is given."""
        self._builder.reschedule(schedule, memory_limit)
        return self

    def explain(self) -> str:
        """What `zbcompile inspect` prints for the latest compile: stages, balance, costs, predicted and measured
        times, each pipeline rank's bytes of parameters, gradients and optimizer state under `data_parallel`, and
        the measured-cost tuner's decisions (each trial's measured steps)."""
        tuner = self.tuner
        lines = [*(tuner_lines(tuner.history) if tuner is not None else []), *self._builder.cache.lines()]
        return "\n".join([summary_text(live_dump(self, self._builder.latest().dump)), *lines])

    @property
    def compiled(self) -> CompiledPipeline:
        """The compiler's result for the latest step's shapes."""
        return self._builder.latest().compiled

    @property
    def forward_runner(self) -> ForwardRunner | None:
        """What ran the latest `evaluate()` (its forward-only compile and schedule, and the memory
        it measures with `measure_transients()`); None before the first."""
        return self._builder.evaluation.latest

    @property
    def schedule(self) -> Schedule:
        return self.runner.schedule

    @property
    def runner(self) -> Runner:
        return self._builder.latest().runner

    @property
    def tuner(self) -> profile.CostTuner | None:
        """What measures the costs of the latest compile and re-solves with them (its `history`
        of decisions); None where costs are not measured."""
        return self._builder.latest().tuner

    @property
    def executors(self) -> list[StageExecutor]:
        return list(self.runner.executors.values())

    def __repr__(self) -> str:
        o = self.options
        fields = f"stages={o.stages}, microbatches={o.microbatches}, schedule={schedule_label(o.schedule)}"
        return f"PipelinedModule({fields}, module={self.module!r})"


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode, then each back in the mode it had."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _forward_pass(builder: Builder, inputs: tuple, kwargs: dict, target: Any, outputs: bool) -> Any:
    """`evaluate()`'s result (its output with `outputs`) in the module's current mode."""
    runner, micro_inputs, micro_targets, absent = builder.evaluation.prepare(inputs, kwargs, target, outputs)
    stages = len(runner.compiled.programs)
    feeds, targets = batch.fed(runner, micro_inputs, micro_targets, absent, builder.ownership, stages)
    if outputs:
        results = runner.run(feeds, targets)
        names, structure = runner.compiled.result_names, runner.compiled.traced.output_structure
        return None if results is None else structure.rebuild([[r[n] for n in names] for r in results])
    reduction = builder.evaluation.loss_reduction(runner, micro_inputs, feeds, targets)
    results = runner.run(feeds, targets)
    return reduction.loss([r["loss"] for r in results] if results is not None else None)
