"""Gradients compared with the eager reference, parameter by parameter."""

from __future__ import annotations

import torch
from torch import nn

FP32 = dict(rtol=1e-5, atol=1e-6)


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def assert_grads_close(actual: dict, expected: dict, what: str, **tolerance) -> None:
    assert list(actual) == list(expected), f"{what}: parameter names differ"
    for fqn, grad in expected.items():
        assert grad is not None, f"eager model has no gradient for {fqn}"
        assert actual[fqn] is not None, f"{what}: {fqn} got no gradient"
        torch.testing.assert_close(actual[fqn], grad, **tolerance, msg=lambda m, fqn=fqn: f"{what}: {fqn}: {m}")
