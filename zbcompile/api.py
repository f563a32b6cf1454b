"""`zbcompile.pipeline()`: wrap a model (or decorate its class) so that `step()` runs one
pipelined forward + backward over all microbatches. Compilation happens on the first step and
again whenever a step's microbatch shapes, dtypes or constant arguments differ."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zbcompile.compiler import CompiledPipeline, compile_pipeline
from zbcompile.runtime.local import run_local_step
from zbcompile.runtime.stage import StageExecutor
from zbcompile.schedules import Costs, Schedule, make_schedule

DEFAULT_SCHEDULE = "zb-auto"


@dataclass(frozen=True)
class PipelineOptions:
    stages: int
    microbatches: int
    loss_fn: Callable[..., torch.Tensor] | None = None
    schedule: str = DEFAULT_SCHEDULE
    split_points: tuple[str, ...] | None = None
    memory_limit: float | Sequence[float] | None = None


def pipeline(
    model: nn.Module | type | None = None,
    *,
    stages: int,
    microbatches: int = 1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    split_points: Sequence[str] | None = None,
    memory_limit: float | Sequence[float] | None = None,
):
    """Make `model` a pipelined model: `pipeline(model, stages=4, microbatches=8, loss_fn=F.mse_loss)`.

    Also a class decorator: `@pipeline(stages=4, ...)` on an `nn.Module` subclass makes its
    constructor return a `PipelinedModule` around the new instance.
    `loss_fn(output, target)` must return the mean loss of a microbatch; without one, the
    model's forward must return that loss itself. `split_points` are module FQNs where a new
    stage begins (otherwise the stages are balanced by cost). `memory_limit` bounds each stage's
    activation memory in units of one microbatch's activations (zb-auto, zbv).
    """
    options = PipelineOptions(
        stages, microbatches, loss_fn, schedule, tuple(split_points) if split_points is not None else None, memory_limit
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


class PipelinedModule:
    """A model trained with a pipeline schedule. Parameters, buffers and `state_dict()` are the
    wrapped module's own (same objects, same FQNs), so optimizers built on `parameters()` work.
    Calling the object runs the unpipelined forward (inference)."""

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        self.module = module
        self.options = options
        self._compiled: dict[Any, tuple[CompiledPipeline, Schedule, list[StageExecutor]]] = {}
        self._last_key: Any = None

    # --- training --------------------------------------------------------------------------

    def step(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One pipelined forward + backward over the batch: splits every tensor in `inputs`,
        `kwargs` and `target` into `microbatches` equal parts along dim 0, runs the schedule,
        accumulates the gradient of the mean microbatch loss into each parameter's `.grad`, and
        returns that mean loss."""
        micro_inputs, micro_targets, key = self._split(inputs, kwargs, target)
        compiled, schedule, executors = self._compile(key, micro_inputs[0], micro_targets[0])
        feeds = [self._feed(compiled, args, kw, tgt) for (args, kw), tgt in zip(micro_inputs, micro_targets)]
        losses = run_local_step(executors, schedule, [f[0] for f in feeds], [f[1] for f in feeds])
        self._accumulate_grads(executors)
        return torch.stack(losses).mean().detach()

    @property
    def compiled(self) -> CompiledPipeline:
        """The compiler's result for the latest step's shapes."""
        if self._last_key is None:
            raise RuntimeError("the pipeline compiles on the first step(); call step() first")
        return self._compiled[self._last_key][0]

    @property
    def schedule(self) -> Schedule:
        if self._last_key is None:
            raise RuntimeError("the pipeline compiles on the first step(); call step() first")
        return self._compiled[self._last_key][1]

    @property
    def executors(self) -> list[StageExecutor]:
        return self._compiled[self._last_key][2]

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
        if batch % m:
            raise ValueError(
                f"the batch of {batch} samples does not split into microbatches={m} equal microbatches; "
                f"use a batch size divisible by {m}"
            )

        def chunks(values: list) -> list[list]:
            return [[v.chunk(m)[i] if isinstance(v, torch.Tensor) else v for v in values] for i in range(m)]

        micro_inputs = [pytree.tree_unflatten(c, spec) for c in chunks(leaves)]
        micro_targets = (
            [pytree.tree_unflatten(c, target_spec) for c in chunks(target_leaves)] if target is not None else [None] * m
        )
        key = (
            spec,
            target_spec,
            tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else _constant_key(t) for t in [*leaves, *target_leaves]),
        )
        return micro_inputs, micro_targets, key

    def _compile(self, key: Any, example: tuple, example_target: Any):
        if key not in self._compiled:
            args, kwargs = example
            compiled = compile_pipeline(
                self.module, self.options.loss_fn, args, kwargs, example_target, self.options.stages, self.options.split_points
            )
            schedule = make_schedule(
                self.options.schedule,
                stages=self.options.stages,
                microbatches=self.options.microbatches,
                costs=schedule_costs(compiled),
                memory_limit=self.options.memory_limit,
            )
            state = self._state()
            executors = [StageExecutor(p, state) for p in compiled.programs]
            self._compiled[key] = (compiled, schedule, executors)
        self._last_key = key
        return self._compiled[key]

    def _state(self) -> dict[str, torch.Tensor]:
        state = {f"param:{n}": p for n, p in self.module.named_parameters()}
        state.update({f"buffer:{n}": b for n, b in self.module.named_buffers()})
        return state

    @staticmethod
    def _feed(compiled: CompiledPipeline, args: tuple, kwargs: dict, target: Any):
        traced = compiled.traced
        leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
        # the graphs were traced on contiguous tensors
        tensors = [x.contiguous() for x in leaves if isinstance(x, torch.Tensor)]
        inputs = {f"input_{i}": t for i, t in enumerate(tensors)}
        target_tensors = [t.contiguous() for t in pytree.tree_leaves(target)]
        targets = {f"target_{i}": t for i, t in enumerate(target_tensors)} if traced.target_spec else {}
        return inputs, targets

    def _accumulate_grads(self, executors: list[StageExecutor]) -> None:
        """Sum each parameter's per-stage gradients in stage order (a tied weight has one per
        stage that uses it) and add the sum to `.grad`."""
        per_stage = [e.take_grads() for e in executors]
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                parts = [grads[name] for grads in per_stage if name in grads]
                if not parts:
                    continue
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                if param.grad is None:
                    param.grad = total
                else:
                    param.grad.add_(total)

    # --- the wrapped module's interface ----------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.module.buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

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


def _constant_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def schedule_costs(compiled: CompiledPipeline) -> Costs:
    """Per-stage schedule costs from the static estimates: times in FLOP-equivalents, memory in
    units of the largest stage's per-microbatch activations (F keeps max(M_B, M_W) so that the
    model never undercounts the backward's peak)."""
    costs = [p.cost for p in compiled.programs]
    unit = max([max(c.mem_b, c.mem_w) for c in costs] + [1])
    return Costs(
        f=[c.forward.time_estimate for c in costs],
        b=[c.input_backward.time_estimate for c in costs],
        w=[c.weight_backward.time_estimate for c in costs],
        mem_f=[max(c.mem_b, c.mem_w) / unit for c in costs],
        mem_w=[c.mem_w / unit for c in costs],
    )
