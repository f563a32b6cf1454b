"""Global gradient-norm clipping and non-finite skipping for a pipelined model, without a
pipeline-wide synchronisation before the optimizer step (optimizer post-validation, Qi et al.
2024, section 4).

`PostValidatedOptimizer` wraps any `torch.optim` optimizer. On pipeline rank r of P:

1. `opt.step()`: the rank computes the squared norm of its gradients (float64; a tied weight
   counts on its owner rank only; a data-parallel replica counts its own pipeline, its
   gradients being the replicas' average; with data_parallel="shard", each replica's shards
   summed over the replicas by an all-reduce), adds the partial sum received from rank r+1 (the
   last stage finishes its backward first) and sends the result to rank r-1. Unless that
   partial state already demands a clip or a skip, the rank steps at once (optimistically,
   after `prepare()` of its rollback); otherwise it defers its step. Rank 0 ends with the
   global state and applies it directly.
2. At the start of the next `pipe.step()` (a pre-step hook, before this rank's first forward)
   or at `opt.finish()`, the global state travels 0 -> 1 -> ... -> P-1. Each rank forwards it,
   then validates: clip -> roll back (if it stepped) and step with the global coefficient;
   non-finite -> roll back and skip (the step counter included); fine -> keep the step.

`SynchronousClipOptimizer` is the same contract with the usual barrier: the ranks of a
pipeline exchange their squared norms (all-gather) before anyone steps. Both sum the norm in
the same order, so with `rollback="exact"` the two give bitwise equal results.

The clip coefficient is torch.nn.utils.clip_grad_norm_'s: max_norm / (total_norm + 1e-6)
clamped to 1, computed on a float32 total norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zbcompile.runtime.state.rollback import make_rollback
from zbcompile.runtime.step.distributed import DistributedRunner
from zbcompile.runtime.step.transport import Transport

PARTIAL_TAG = 1 << 24  # above every tag of a step's activation and gradient messages
GLOBAL_TAG = PARTIAL_TAG + 1


@dataclass(frozen=True)
class NormState:
    """Sum of squared gradient norms over some ranks, and whether any gradient was non-finite."""

    sumsq: float = 0.0
    nonfinite: bool = False

    def plus(self, other: NormState) -> NormState:
        return NormState(self.sumsq + other.sumsq, self.nonfinite or other.nonfinite)

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.sumsq, float(self.nonfinite)], dtype=torch.float64, device=device)

    @staticmethod
    def from_tensor(value: torch.Tensor) -> NormState:
        sumsq, flag = value.tolist()
        return NormState(sumsq, bool(flag))


def squared_norm(grads: Iterable[torch.Tensor]) -> NormState:
    """Sum of squares of every element of `grads`, accumulated in float64 in the given order, on
    the gradients' device: one host synchronisation (the final `.item()`), not one per gradient."""
    total: torch.Tensor | None = None
    for g in grads:
        part = g.detach().to(torch.float64).square().sum()
        total = part.clone() if total is None else total + part.to(total.device)
    value = 0.0 if total is None else total.item()
    return NormState(value, not math.isfinite(value))


def _sharded_over(grad: torch.Tensor) -> frozenset[str]:
    """The mesh dimensions a DTensor gradient is sharded over (none for a plain tensor)."""
    if not isinstance(grad, DTensor):
        return frozenset()
    names = grad.device_mesh.mesh_dim_names or ()
    return frozenset(n for n, p in zip(names, grad.placements) if not (p.is_replicate() or p.is_partial()))


def chain_sum(partials: list[NormState]) -> NormState:
    """The global state the chain last -> 0 produces from each pipeline rank's own state."""
    total = NormState()  # 0.0 + x == x: the last rank's own state, exactly
    for own in reversed(partials):
        total = total.plus(own)
    return total


def clip_coefficient(state: NormState, max_norm: float | None) -> torch.Tensor | None:
    """torch.nn.utils.clip_grad_norm_'s clamped coefficient for this total, or None when the
    gradients stay as they are (no max_norm, or a coefficient of exactly 1)."""
    if max_norm is None:
        return None
    total_norm = torch.tensor(math.sqrt(state.sumsq) if state.sumsq >= 0 else math.nan, dtype=torch.float32)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    return None if coef.item() == 1.0 else coef


@dataclass
class StepRecord:
    """How one optimizer step was finally applied (available once it is validated)."""

    total_norm: float
    clipped: bool
    skipped: bool


@dataclass
class _Pending:
    """A step this rank has taken optimistically (`stepped`) or deferred, awaiting the global state."""

    grads: dict[torch.Tensor, torch.Tensor]
    stepped: bool
    global_state: NormState | None = None  # known on pipeline rank 0


@dataclass
class _Position:
    """This rank's place in its pipeline's chain: global ranks of its neighbours (None at an end)."""

    previous: int | None
    next: int | None
    pipeline_group: Any = None
    pipeline_size: int = 1
    rank: int = 0
    counted: Callable[[torch.Tensor], bool] = field(default=lambda p: True)
    replica_group: Any = None  # the data-parallel replicas of this pipeline rank (None: one)


class _PipelineOptimizer:
    """Pass-through of a wrapped torch optimizer plus the clip/skip arithmetic both variants share."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, pipe: Any, max_norm: float | None = None, skip_nonfinite: bool = True
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer to wrap, got {type(optimizer).__name__}")
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number or None, got {max_norm!r}")
        self.optimizer = optimizer
        self.pipe = pipe
        self.max_norm = None if max_norm is None else float(max_norm)
        self.skip_nonfinite = skip_nonfinite
        self.history: list[StepRecord] = []

    # --- torch.optim.Optimizer's interface --------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group: dict) -> None:
        self.optimizer.add_param_group(group)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.optimizer!r}, max_norm={self.max_norm}, skip_nonfinite={self.skip_nonfinite})"
        )

    # --- shared arithmetic ------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _grads(self) -> dict[torch.Tensor, torch.Tensor]:
        return {p: p.grad for p in self._params() if p.grad is not None}

    def _own_state(self, position: _Position, grads: dict[torch.Tensor, torch.Tensor]) -> NormState:
        """This pipeline rank's squared norm; a gradient sharded over the replicas or the
        tensor-parallel ranks (a DTensor: data_parallel="shard", tensor parallelism) counts its
        local shard, summed over the ranks of the mesh dimensions it is sharded over (one sum
        over "dp", then one over "tp", on every rank of those groups)."""
        counted = [g for p, g in grads.items() if position.counted(p)]
        if not any(isinstance(g, DTensor) for g in counted):
            return squared_norm(counted)
        parts: dict[frozenset[str], list[torch.Tensor]] = {}
        for g in counted:
            local = g.to_local() if isinstance(g, DTensor) else g
            parts.setdefault(_sharded_over(g), []).append(local)
        sums = {dims: squared_norm(tensors).sumsq for dims, tensors in parts.items()}
        total = sums.pop(frozenset(), 0.0)
        tp_group = getattr(self.pipe.runner.layout, "tp_group", None)
        for dimension, group in (("dp", position.replica_group), ("tp", tp_group)):
            if group is None:
                continue
            over = sorted((dims for dims in sums if dimension in dims), key=sorted)
            vector = torch.tensor([sums[d] for d in over] or [0.0], dtype=torch.float64, device=self.pipe.runner.device)
            dist.all_reduce(vector, group=group)
            sums.update(zip(over, vector.tolist()))
        value = total + sum(sums.values())
        return NormState(value, not math.isfinite(value))

    def _verdict(self, state: NormState) -> tuple[bool, torch.Tensor | None]:
        """(skip, clip coefficient or None) for a global state."""
        if state.nonfinite and self.skip_nonfinite:
            return True, None
        return False, clip_coefficient(state, self.max_norm)

    def _apply(self, grads: dict[torch.Tensor, torch.Tensor], state: NormState) -> None:
        """Step as the global `state` says (clip, skip or as is), on `grads`."""
        skip, coef = self._verdict(state)
        self._record(state, coef, skip)
        if not skip:
            self._step_on(grads, coef)

    def _step_on(self, grads: dict[torch.Tensor, torch.Tensor], coef: torch.Tensor | None) -> None:
        """`optimizer.step()` with `.grad` set to `grads` (times `coef`, like clip_grad_norm_'s
        in-place multiply); every `.grad` is restored afterwards."""
        saved = {p: p.grad for p in self._params()}
        try:
            for p in saved:
                g = grads.get(p)
                p.grad = None if g is None else (g if coef is None else g.mul(coef.to(g.device)))
            self.optimizer.step()
        finally:
            for p, g in saved.items():
                p.grad = g

    def _record(self, state: NormState, coef: torch.Tensor | None, skip: bool) -> None:
        self.history.append(
            StepRecord(math.sqrt(state.sumsq) if state.sumsq >= 0 else math.nan, coef is not None, skip)
        )

    def _position(self) -> _Position:
        """This rank's chain neighbours and which of its parameters count in the norm."""
        runner = self.pipe.runner
        if not isinstance(runner, DistributedRunner):
            return _Position(None, None)
        layout = runner.layout
        names = {p: n for n, p in self.pipe.named_parameters()}
        foreign = {t.fqn for t in runner.tied_weights if t.owner != runner.rank}
        ranks = layout.pipeline_ranks
        return _Position(
            previous=ranks[layout.pp_rank - 1] if layout.pp_rank > 0 else None,
            next=ranks[layout.pp_rank + 1] if layout.pp_rank + 1 < layout.pp_size else None,
            pipeline_group=layout.pp_group, pipeline_size=layout.pp_size, rank=runner.rank,
            counted=lambda p: names.get(p) not in foreign, replica_group=layout.dp_group,
        )


class PostValidatedOptimizer(_PipelineOptimizer):
    """`optimizer` with global gradient clipping (`max_norm`) and non-finite skipping, validated
    after the fact so that no rank waits for the whole pipeline before its optimizer step.

        opt = PostValidatedOptimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3), pipe, max_norm=1.0)
        for x, y in data:
            pipe.step(x, target=y); opt.step(); opt.zero_grad()
        opt.close()  # validate the last step (every rank calls it)

    Build it after `pipe.compile(...)` (or a first step) on every rank. A step is final once the
    next `pipe.step()` starts, or after `finish()`; until then `state_dict()` and
    `load_state_dict()` here and `pipe.state_dict()` raise (call `finish()` first). `rollback`:
    "exact" (snapshot: one more copy of this rank's stepped parameters and their optimizer
    state while a step is unvalidated) or "reverse" (inverse formulas in place, SGD/Adam/AdamW
    only, a few ulps of rounding). `.grad` keeps the unclipped gradients. `history` holds one
    `StepRecord` per validated step (identical on every rank of a pipeline).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pipe: Any,
        max_norm: float | None = None,
        skip_nonfinite: bool = True,
        rollback: str = "exact",
    ) -> None:
        super().__init__(optimizer, pipe, max_norm, skip_nonfinite)
        self.rollback = make_rollback(optimizer, rollback)
        self.rollbacks = 0  # optimistic steps undone
        self._pending: _Pending | None = None
        self._transport: Transport | None = None
        pipe.pre_step_hooks.append(self.finish)
        pipe.state_dict_hooks.append(self._refuse_unvalidated)

    @property
    def validating(self) -> bool:
        return self.max_norm is not None or self.skip_nonfinite

    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise TypeError("PostValidatedOptimizer.step() takes no closure: the loss comes from pipe.step()")
        self.finish()  # a previous step not yet validated (step() twice in a row)
        if not self.validating:
            self.optimizer.step()
            return
        position = self._position()
        transport = self._transport_for(position)
        grads = self._grads()
        state = self._own_state(position, grads)
        if position.next is not None:
            action = "optimizer step (partial gradient norm)"
            state = self._receive(transport, position.next, PARTIAL_TAG, action).plus(state)
        if position.previous is None:  # pipeline rank 0: the global state is known
            self._apply(grads, state)
            if position.next is not None:
                self._pending = _Pending(grads, stepped=False, global_state=state)
            return
        transport.complete_messages()
        transport.send([state.to_tensor(self._device())], position.previous, PARTIAL_TAG, "partial gradient norm")
        skip, coef = self._verdict(state)
        stepped = not skip and coef is None
        if stepped:
            self.rollback.prepare()
            self.optimizer.step()
        self._pending = _Pending(grads, stepped)

    def finish(self) -> None:
        """Validate the step taken last, if any: receive the global state from the previous
        pipeline rank, pass it on, then keep, redo (clipped) or undo the step. Every rank of the
        pipeline must call it (the next `pipe.step()` does)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        position = self._position()
        transport = self._transport_for(position)
        state = pending.global_state
        if position.previous is not None:
            state = self._receive(transport, position.previous, GLOBAL_TAG, "post-validation (global gradient norm)")
        transport.complete_messages()
        if position.next is not None:
            transport.send([state.to_tensor(self._device())], position.next, GLOBAL_TAG, "global gradient norm")
        if position.previous is None:
            return  # rank 0 applied the global state in step()
        skip, coef = self._verdict(state)
        if pending.stepped and (skip or coef is not None):
            self.rollback.undo(pending.grads)
            self.rollbacks += 1
        elif pending.stepped:
            self.rollback.discard()
        self._record(state, coef, skip)
        if not skip and (coef is not None or not pending.stepped):
            self._step_on(pending.grads, coef)

    def close(self) -> None:
        """Validate the last step, wait until the neighbours have our messages, and detach from
        the pipe (its next steps no longer call us). Every rank of the pipeline must call it."""
        self.finish()
        if self._transport is not None:
            self._transport.complete_messages()
        self.pipe.pre_step_hooks.remove(self.finish)
        self.pipe.state_dict_hooks.remove(self._refuse_unvalidated)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending is not None and not set_to_none:
            # the unvalidated step may be redone with these gradients: give .grad new zeros
            for p in self._params():
                if p.grad is not None:
                    p.grad = torch.zeros_like(p.grad)
            return
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._refuse_unvalidated()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refuse_unvalidated()
        self.optimizer.load_state_dict(state_dict)

    def _refuse_unvalidated(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "the last optimizer step is not validated yet (its global gradient norm is still travelling "
                "along the pipeline); call opt.finish() on every rank first"
            )

    def _receive(self, transport: Transport, peer: int, tag: int, action: str) -> NormState:
        buffer = torch.empty(2, dtype=torch.float64, device=self._device())
        return NormState.from_tensor(transport.wait(transport.post_recv([buffer], peer, tag, action), action)[0])

    def _transport_for(self, position: _Position) -> Transport:
        if self._transport is None:
            self._transport = Transport(position.rank, self.pipe.options.timeout, position.pipeline_group)
        return self._transport

    def _device(self) -> torch.device:
        runner = self.pipe.runner
        return runner.device if isinstance(runner, DistributedRunner) else torch.device("cpu")


class SynchronousClipOptimizer(_PipelineOptimizer):
    """The same clip/skip with a barrier: the pipeline's ranks all-gather their squared norms
    before every step (what post-validation removes). Sums in the chain's order, so it is
    bitwise equal to `PostValidatedOptimizer(..., rollback="exact")`."""

    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise TypeError("SynchronousClipOptimizer.step() takes no closure: the loss comes from pipe.step()")
        position = self._position()
        grads = self._grads()
        own = self._own_state(position, grads)
        partials = [own]
        if position.pipeline_group is not None:
            device = self.pipe.runner.device
            gathered = [torch.empty(2, dtype=torch.float64, device=device) for _ in range(position.pipeline_size)]
            dist.all_gather(gathered, own.to_tensor(device), group=position.pipeline_group)
            partials = [NormState.from_tensor(t) for t in gathered]
        self._apply(grads, chain_sum(partials))

    def finish(self) -> None:
        """Nothing to validate (every step is final); for the same loop as PostValidatedOptimizer."""

    close = finish
