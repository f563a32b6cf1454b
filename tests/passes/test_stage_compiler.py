"""compiler="inductor": every stage's F, B and W run as Inductor-generated code and the step's
gradients equal eager's within fp32 tolerance (one small case: Inductor compiles slowly on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zbcompile
from zbcompile.stage_compiler import InductorProgram


def test_inductor_stage_programs_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))
    reference = copy.deepcopy(model)
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    pipe = zbcompile.pipeline(
        model,
        stages=2,
        microbatches=2,
        loss_fn=nn.functional.mse_loss,
        schedule="zb-h1",
        split_points=["2"],
        compiler="inductor",
    )
    loss = pipe.step(x, target=target)

    losses = [nn.functional.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), target.chunk(2))]
    expected = torch.stack(losses).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    first, last = pipe.compiled.programs
    ran = [first.forward, first.weight_backward, last.forward, last.input_backward, last.weight_backward]
    assert all(isinstance(p, InductorProgram) and p._compiled for p in ran), "every F, B and W ran compiled"
    assert not isinstance(first.input_backward, InductorProgram)  # the first stage's B is empty


def test_unknown_compiler_is_refused():
    with pytest.raises(ValueError, match="unknown compiler 'tvm'"):
        zbcompile.pipeline(nn.Linear(2, 2), stages=1, compiler="tvm")
