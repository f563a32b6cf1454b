"""Undo one optimizer step: restore the parameters and the optimizer state to what they were
just before `optimizer.step()`.

Two ways, one interface (`prepare()` before the step, then `undo(grads)` or `discard()`):

- `ExactRollback` copies what the step may change (every parameter with a gradient and its
  optimizer state) before the step and copies it back: bit for bit, at the memory cost of one
  more copy of those parameters and their optimizer state, held only while the step is
  unvalidated.
- `ReverseRollback` applies the inverse update formulas of SGD (momentum, dampening, Nesterov,
  weight decay, maximize), Adam and AdamW in place: no extra memory, but floating-point
  rounding makes the restored values differ from the originals by a few ulps (see
  docs/post_validation.md). It needs the gradients the step used.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

REVERSIBLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters `optimizer.step()` would update now (those with a gradient)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class ExactRollback:
    """Snapshot before the step, copy back on undo."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._params: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._state: dict[torch.Tensor, dict[str, Any] | None] = {}

    def prepare(self) -> None:
        params = _stepped_params(self.optimizer)
        with torch.no_grad():
            self._params = [(p, p.detach().clone()) for p in params]
        states = self.optimizer.state
        self._state = {p: {k: _clone(v) for k, v in states[p].items()} if states.get(p) else None for p in params}

    def undo(self, grads: Mapping[torch.Tensor, torch.Tensor]) -> None:
        if self._params is None:
            raise RuntimeError("ExactRollback.undo() without prepare()")
        with torch.no_grad():
            for p, saved in self._params:
                p.copy_(saved)
        for p, state in self._state.items():
            if state is None:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = state
        self.discard()

    def discard(self) -> None:
        self._params, self._state = None, {}

    @property
    def held_bytes(self) -> int:
        """Bytes of the snapshot now held (0 when no step is unvalidated)."""
        tensors = [saved for _, saved in self._params or []]
        tensors += [v for state in self._state.values() for v in (state or {}).values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class ReverseRollback:
    """Undo SGD, Adam or AdamW in place with their inverse formulas."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer) not in REVERSIBLE:
            raise TypeError(
                f'rollback="reverse" knows the inverse update of SGD, Adam and AdamW, not of '
                f'{type(optimizer).__name__}; use rollback="exact" (it snapshots the parameters and state)'
            )
        for i, group in enumerate(optimizer.param_groups):
            if group.get("amsgrad"):
                raise ValueError(
                    f'rollback="reverse" cannot undo amsgrad=True (param group {i}): the running maximum of '
                    'the second moment forgets the value it replaced; use rollback="exact"'
                )
        for i, group in enumerate(optimizer.param_groups):
            narrow = [p for p in group["params"] if p.is_floating_point() and p.element_size() < 4]
            if narrow:
                raise ValueError(
                    f'rollback="reverse" cannot undo steps of {narrow[0].dtype} parameters (param group {i}, e.g. one '
                    f"of shape {tuple(narrow[0].shape)}): an update near the value's rounding step does not come back "
                    'by the inverse formula (off by one unit in the last place, a relative 1e-2 in bfloat16); use '
                    'rollback="exact"'
                )
        self.optimizer = optimizer
        self._fresh: set[torch.Tensor] = set()  # parameters without state before the step

    def prepare(self) -> None:
        self._fresh = {p for p in _stepped_params(self.optimizer) if not self.optimizer.state.get(p)}

    def discard(self) -> None:
        self._fresh = set()

    def undo(self, grads: Mapping[torch.Tensor, torch.Tensor]) -> None:
        undo_one = _undo_sgd if isinstance(self.optimizer, torch.optim.SGD) else _undo_adam
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    grad = grads.get(p)
                    if grad is not None:
                        undo_one(p, grad, self.optimizer.state, group, p in self._fresh)
        self.discard()


def _undo_sgd(p: torch.Tensor, grad: torch.Tensor, states: dict, group: dict, fresh: bool) -> None:
    """Inverse of torch's SGD step: g' = g + wd p; buf = mu buf + (1 - damp) g' (buf = g' on the
    first step); d = g' + mu buf (Nesterov) or buf; p -= lr d."""
    lr, wd, mu, damp = float(group["lr"]), group["weight_decay"], group["momentum"], group["dampening"]
    g = -grad if group["maximize"] else grad
    if mu == 0:
        p.add_(g, alpha=lr)
        if wd:
            p.div_(1 - lr * wd)
        return
    state = states[p]
    buf = state["momentum_buffer"]
    if fresh:  # buf was g' itself
        p.add_(buf, alpha=lr * (1 + mu) if group["nesterov"] else lr)
        states.pop(p, None)
        return
    if group["nesterov"]:  # p = p0 - lr (g + wd p0 + mu buf)
        p.add_(g + mu * buf, alpha=lr)
        if wd:
            p.div_(1 - lr * wd)
    else:
        p.add_(buf, alpha=lr)
    g_wd = g + wd * p if wd else g
    buf.sub_(g_wd, alpha=1 - damp).div_(mu)


def _undo_adam(p: torch.Tensor, grad: torch.Tensor, states: dict, group: dict, fresh: bool) -> None:
    """Inverse of torch's Adam/AdamW step at step t: p += lr/(1-b1^t) m / (sqrt(v)/sqrt(1-b2^t)
    + eps); p /= (1 - lr wd) (AdamW); m = (m - (1-b1) g)/b1; v = (v - (1-b2) g^2)/b2; t -= 1."""
    state = states[p]
    lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    step_t = state["step"]
    t = float(step_t)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    bias1, bias2 = 1 - beta1**t, 1 - beta2**t
    denom = (v.sqrt() / bias2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=lr / bias1)
    decoupled = group.get("decoupled_weight_decay", False)  # True for AdamW
    if wd and decoupled:
        p.div_(1 - lr * wd)
    if fresh:  # the first step started from no state: drop it
        states.pop(p, None)
        return
    g = -grad if group["maximize"] else grad
    if wd and not decoupled:
        g = g + wd * p
    m.sub_(g, alpha=1 - beta1).div_(beta1)
    v.sub_(g * g, alpha=1 - beta2).div_(beta2).clamp_(min=0)
    if isinstance(step_t, torch.Tensor):
        step_t.sub_(1)
    else:
        state["step"] = step_t - 1


def make_rollback(optimizer: torch.optim.Optimizer, mode: str) -> ExactRollback | ReverseRollback:
    if mode == "exact":
        return ExactRollback(optimizer)
    if mode == "reverse":
        return ReverseRollback(optimizer)
    raise ValueError(f'rollback must be "exact" or "reverse", got {mode!r}')
