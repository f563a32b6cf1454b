"""Runs one stage's F, I, W and fused B for any microbatch, keeping each microbatch's values in
its own environment and freeing every value right after its last use. Transport-agnostic: the caller
hands in what arrives from the neighbours and sends what comes back."""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from zbcompile.compiler import StageProgram
from zbcompile.passes._fx import size_hint
from zbcompile.passes.partition import Stage
from zbcompile.passes.program import Program
from zbcompile.passes.shape_symbols import is_symbolic
from zbcompile.passes.trace_errors import first_line, node_location, same_kind
from zbcompile.runtime.step.live_memory import held_bytes, peak_inside
from zbcompile.value_names import (
    OUTPUT,
    buffer_name,
    fqn_of,
    grad_name,
    input_name,
    is_state,
    output_name,
    param_grad_name,
    param_name,
    tangent_name,
    update_name,
)

Tensors = Mapping[str, torch.Tensor]


class StageExecutor:
    """Executes F/I/W/B of one stage; `envs` holds, by microbatch, what its later actions read.
    `state` maps `param:<fqn>` / `buffer:<fqn>` to tensors. Parameter gradients are accumulated
    per microbatch in the order W runs (`add_grads`); `take_grads()` hands them over at the end
    of a step. The buffers the stage updates take their new values right after each F, in place
    (`check_forward_order`). `memory` counts the microbatches' activation memory."""

    def __init__(self, program: StageProgram, state: Mapping[str, torch.Tensor]) -> None:
        self.program = program
        self.state = state
        self.envs: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.memory = ActivationCount()
        self._last_forward = -1  # the microbatch of the latest F
        joint, split = program.joint, program.split
        self._backward_reads = {n for n in joint.backward.signature.inputs if not is_state(n)}
        # what F keeps of its inputs: what the backward reads, and those it relays as outputs
        self._forward_keeps = self._backward_reads | {input_name(v) for v in program.stage.outputs}
        self._weight_reads = set(split.weight_reads)
        self._weight_param_grads = [f for f in joint.param_grads if f not in split.input_param_grads]
        self._layouts = {**placeholder_layouts(joint.forward), **placeholder_layouts(joint.backward)}

    def running(self, program: StageProgram) -> "StageExecutor":
        """An executor of the same stage and state running `program` (the stage at another
        recompute level), measuring as this one does. Between steps only."""
        if self.envs:
            raise RuntimeError(
                f"stage {self.program.stage.index}: microbatches {sorted(self.envs)} are in flight; change programs "
                "between steps"
            )
        executor = StageExecutor(program, self.state)
        executor.memory.measure_transients = self.memory.measure_transients
        return executor

    # --- actions ---------------------------------------------------------------------------

    def forward(self, microbatch: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """F. `inputs`: every stage input (and target) by value name. Returns the stage outputs
        by value name (`{"loss": ...}` on the last stage)."""
        stage, layouts = self.program.stage, self._layouts
        check_forward_order(stage, microbatch, self._last_forward)
        self._last_forward = microbatch
        env = {input_name(name): as_traced(value, layouts.get(input_name(name))) for name, value in inputs.items()}
        self._run("F", self.program.joint.forward, env, microbatch, keep=self._forward_keeps)
        outputs = forward_results(stage, self.program.joint.forward, env, self.state)
        kept = self.envs[microbatch] = {k: v for k, v in env.items() if k in self._backward_reads}
        self.memory.note(microbatch, "F", kept.values())
        return outputs

    def input_backward(self, microbatch: int, output_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """I. `output_grads`: gradients of the stage outputs (`{"loss": scale}` on the last
        stage). Returns the gradients of the stage inputs that carry one."""
        env = self.envs[microbatch]
        self._receive_tangents(env, output_grads)
        self._run("I", self.program.split.input_backward, env, microbatch, keep=self._weight_reads)
        add_grads(self.grads, self.program.split.input_param_grads, env, self.state)
        kept = self.envs[microbatch] = {k: v for k, v in env.items() if k in self._weight_reads}
        self.memory.note(microbatch, "I", kept.values())
        return input_grads(self.program.stage, env, output_grads)

    def weight_backward(self, microbatch: int) -> None:
        """W: parameter gradients of `microbatch`, accumulated; the microbatch's values freed."""
        env = self.envs.pop(microbatch)
        self._run("W", self.program.split.weight_backward, env, microbatch, keep=frozenset())
        add_grads(self.grads, self._weight_param_grads, env, self.state)
        self.memory.note(microbatch)

    def backward(self, microbatch: int, output_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fused backward B (I then W at once) as the one unsplit backward graph, which computes
        exactly what I and W compute, with no stash handed between them."""
        env = self.envs.pop(microbatch)
        self._receive_tangents(env, output_grads)
        self._run("B", self.program.joint.backward, env, microbatch, keep=frozenset())
        add_grads(self.grads, self.program.joint.param_grads, env, self.state)
        self.memory.note(microbatch)
        return input_grads(self.program.stage, env, output_grads)

    def _run(
        self, kind: str, program: Program, env: dict[str, torch.Tensor], microbatch: int, keep: Collection[str]
    ) -> None:
        """Run `program` (the action `kind`: F, I, W or B) on `microbatch`'s `env` (what the
        action took in). The values the microbatch does not `keep` after this action leave `env`
        and the graph frees each at its last use. An op that fails raises `op_error`'s error."""
        consumed = [name for name in env if name not in keep]
        try:
            if self.memory.measure_transients:
                self.memory.measure(lambda: program.run(env, self.state, consumed), microbatch, env)
            else:
                program.run(env, self.state, consumed)
        except Exception as error:  # noqa: BLE001 - re-raised, naming the module and line of the op
            node = program.failing_node(error)
            if node is None:
                raise
            raise op_error(f"{self.program.stage.index}{kind}{microbatch}", node, error) from error

    def _receive_tangents(self, env: dict[str, torch.Tensor], output_grads: Mapping[str, torch.Tensor]) -> None:
        for name in self.program.joint.tangents:
            env[tangent_name(name)] = as_traced(output_grads[name], self._layouts.get(tangent_name(name)))

    def take_grads(self) -> dict[str, torch.Tensor]:
        if self.envs:
            raise RuntimeError(
                f"stage {self.program.stage.index}: microbatches {sorted(self.envs)} still hold activations at the "
                "end of the step; the schedule is missing their W actions"
            )
        grads, self.grads = self.grads, {}
        return grads


class ActivationCount:
    """The activation memory of one stage's microbatches, two counts (each storage once):
    - `peak_live_bytes`, always: the most bytes the microbatches' saved values held between
      actions (after F what the backward reads, after I what W reads): the simulator's M_B, M_W;
    - `peak_activation_bytes`, while `measure_transients` (off by default: then free, and 0): the
      most bytes alive at any point inside an action as well: the other microbatches' saved
      values, what the running action took in (its saved values, received values or the batch,
      output gradients), and every storage its graph created and still alive
      (`live_memory.peak_inside`): recomputed forward values, intermediate gradients, the outputs
      it hands on, per-microbatch parameter gradients before they are added. Not counted:
      parameters, buffers, accumulated parameter gradients (one copy per stage whatever the
      schedule), values handed to the neighbours once the action returned (the transport's),
      received values before the action that takes them starts."""

    def __init__(self) -> None:
        self.peak_live_bytes = 0
        self.measure_transients = False
        self.peak_activation_bytes = 0
        self.held: dict[int, int] = {}  # by microbatch in flight, the bytes it holds between actions
        self._held_after: dict[str, int] = {}  # bytes a microbatch holds after F / after I

    def live_bytes(self) -> int:
        """Bytes of activation memory the stashed values of all microbatches in flight hold."""
        return sum(self.held.values())

    def note(self, microbatch: int, phase: str | None = None, kept: Iterable[torch.Tensor] = ()) -> None:
        """Record that `microbatch` holds `kept` after `phase` ("F" or "I"; None: it holds nothing).
        Shapes are fixed at compile time, so every microbatch holds the same bytes after the same
        phase: counted once."""
        if phase is not None:
            if phase not in self._held_after:
                self._held_after[phase] = held_bytes(kept)
            self.held[microbatch] = self._held_after[phase]
        else:
            self.held.pop(microbatch, None)
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes())
        if self.measure_transients:
            self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_bytes())

    def measure(self, run: Callable[[], None], microbatch: int, env: Mapping[str, torch.Tensor]) -> None:
        """`run()` an action of `microbatch` that took in `env`, noting the most bytes alive meanwhile."""
        others = sum(b for k, b in self.held.items() if k != microbatch)
        device = next((v.device for v in env.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        inside = peak_inside(run, env.values(), device)
        self.peak_activation_bytes = max(self.peak_activation_bytes, others + inside)

    def reset_peaks(self) -> None:
        """Start both peak counts afresh (e.g. after a warm-up step)."""
        self.peak_live_bytes = self.peak_activation_bytes = 0


def add_grads(grads: dict[str, torch.Tensor], fqns: Sequence[str], env: Tensors, state: Tensors) -> None:
    """Add one microbatch's parameter gradients (in microbatch order: the same sums, bit for
    bit, under every schedule) into `grads`, in the parameter's `grad_dtype` (torch's attribute,
    by default the parameter's dtype; float32 for fp32 gradient accumulation of a bf16 model; a
    non-leaf's own dtype): each microbatch's gradient is converted, then added, as autograd does
    eagerly."""
    for fqn in fqns:
        grad = env[param_grad_name(fqn)]
        if fqn in grads:
            grads[fqn].add_(grad)
        else:
            param = state[param_name(fqn)]
            dtype = (param.grad_dtype if param.is_leaf else param.dtype) or grad.dtype
            grads[fqn] = grad.detach().to(dtype, copy=True)


def forward_results(stage: Stage, forward: Program, env: Tensors, state: Tensors) -> dict[str, torch.Tensor]:
    """After `forward` (F of `stage`) ran on `env`: the buffers the stage updates take their new
    values in `state`; returns the stage's outputs by value name (the last stage's results by
    their names: `loss`, or `output_<i>`)."""
    with torch.no_grad():
        for fqn in stage.buffer_updates:
            state[buffer_name(fqn)].copy_(env[update_name(fqn)])
    if stage.outputs:
        return {v: env[output_name(v)] if output_name(v) in env else env[input_name(v)] for v in stage.outputs}
    return {fqn_of(n): env[n] for n in forward.signature.outputs if n.startswith(OUTPUT)}


def check_forward_order(stage: Stage, microbatch: int, last_forward: int) -> None:
    """A stage that updates buffers (BatchNorm's running statistics in training) runs F for microbatches
    0, 1, 2, ... of each step, `microbatch` right after `last_forward`: schedules run F in microbatch
    order, so microbatch k reads what k-1 left, as in an eager run microbatch by microbatch."""
    updated = stage.buffer_updates
    if updated and microbatch and last_forward != microbatch - 1:
        raise RuntimeError(
            f"stage {stage.index}: F of microbatch {microbatch} follows F of microbatch "
            f"{last_forward}; the stage updates buffers ({updated[0]}, ...), so its forwards must run "
            "in microbatch order"
        )


def input_grads(stage: Stage, env: Tensors, output_grads: Tensors) -> dict[str, torch.Tensor]:
    """Gradients of `stage`'s inputs: the backward's own (in `env`), plus the relayed ones from
    downstream (in `output_grads`) for inputs the stage passes through."""
    grads = {}
    for name in stage.inputs:
        own = env.get(grad_name(name))
        relayed = output_grads.get(name) if name in stage.relays else None
        if own is not None and relayed is not None:
            grads[name] = own + relayed
        elif own is not None or relayed is not None:
            grads[name] = own if own is not None else relayed
    return grads


def op_error(action: str, node, error: Exception) -> Exception:
    """`error`, raised by the op of `node` while running `action` ("0F3": stage 0's F of
    microbatch 3), as an error of its type naming the action, and the module and source line the
    op was traced from. Tracing computes shapes and
    dtypes with torch's fake kernels, which do not check everything the real kernels do (a
    Linear fed integer tokens traces, then fails here)."""
    return same_kind(
        error,
        f"zbcompile could not run action {action}: the op {node.target} traced at {node_location(node)} failed: "
        f"{type(error).__name__}: {first_line(error)}. Check the dtypes, devices and shapes of what that line "
        "receives (the model's inputs included)",
    )


class DimOrder(tuple):
    """The layout of an input traced with symbolic sizes: its dimensions from the outermost
    (largest stride) to the innermost, densely laid out, whatever the sizes."""

    def strides(self, shape: torch.Size) -> tuple[int, ...]:
        strides, step = [0] * len(shape), 1
        for dim in reversed(self):
            strides[dim], step = step, step * max(shape[dim], 1)
        return tuple(strides)


def as_traced(value: torch.Tensor, stride: tuple[int, ...] | DimOrder | None) -> torch.Tensor:
    """`value` with the strides a graph was traced with (None: any); a received tensor arrives
    contiguous, and the graph may expect, say, a transposed attention output."""
    if stride is None or not isinstance(value, torch.Tensor) or value.numel() <= 1:
        return value
    if isinstance(stride, DimOrder):
        stride = stride.strides(value.shape)
    if value.stride() == stride:
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


def placeholder_layouts(program) -> dict[str, tuple[int, ...] | DimOrder]:
    """The strides of each of `program`'s tensor inputs as traced (their `DimOrder` where traced
    with symbolic sizes), by environment name."""
    layouts = {}
    for node, name in zip(program.graph.graph.find_nodes(op="placeholder"), program.signature.inputs):
        value = node.meta["val"]
        if not isinstance(value, torch.Tensor):
            continue
        strides = tuple(value.stride())
        if is_symbolic(strides):
            hints = [size_hint(s) for s in strides]
            strides = DimOrder(sorted(range(len(hints)), key=lambda d: (-hints[d], d)))
        layouts[name] = strides
    return layouts


def merge_stage_grads(executors: Sequence[StageExecutor]) -> dict[str, torch.Tensor]:
    """The step's gradients of `executors` (in stage order), a parameter used by several of them
    (a tied weight) summed in that order."""
    grads: dict[str, torch.Tensor] = {}
    for executor in executors:
        for fqn, grad in executor.take_grads().items():
            grads[fqn] = grads[fqn] + grad if fqn in grads else grad
    return grads


def accumulate_grads(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Add a step's gradients (by parameter FQN, `Runner.reduce_grads()`) to `module`'s `.grad`
    (a DTensor parameter's local gradient as a DTensor of the parameter's layout)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            grad = grads.get(name)
            if grad is None:
                continue
            if isinstance(param, DTensor) and getattr(grad, "device_mesh", None) != param.device_mesh:
                local = grad.to_local() if isinstance(grad, DTensor) else grad  # a tensor-parallel shard's
                mesh, placements = param.device_mesh, param.placements
                grad = DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
                )
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
