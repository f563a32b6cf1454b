"""compiler="inductor": every stage's F, B and W run as Inductor-generated code and the step's
gradients equal eager's within fp32 tolerance (one small case: Inductor compiles slowly on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zbcompile
from zbcompile import stage_compiler
from zbcompile.stage_compiler import InductorProgram, compile_stage_programs


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


def _compiled_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=nn.functional.mse_loss, compiler="eager")
    x, target = torch.randn(4, 8), torch.randn(4, 4)
    pipe.compile(x, target=target)
    return pipe, x, target


def test_default_compiler_is_inductor_with_a_fallback_on_cuda_and_eager_elsewhere():
    pipe, _, _ = _compiled_mlp()
    on_cpu = compile_stage_programs(pipe.compiled, None, torch.device("cpu"))
    assert on_cpu is pipe.compiled
    on_cuda = compile_stage_programs(pipe.compiled, None, torch.device("cuda"))
    forwards = [p.forward for p in on_cuda.programs]
    assert all(isinstance(f, InductorProgram) and f.fallback for f in forwards)
    asked = compile_stage_programs(pipe.compiled, "inductor", torch.device("cuda"))
    assert not any(p.forward.fallback for p in asked.programs)


def test_a_graph_inductor_cannot_compile_runs_op_by_op_under_the_default(monkeypatch):
    """The default's fallback: a warning naming the stage program, then the eager results; asked
    for by name, Inductor's error is raised."""
    pipe, x, target = _compiled_mlp()
    program = pipe.compiled.programs[0].forward
    placeholders = program.graph.graph.find_nodes(op="placeholder")
    env = {name: torch.randn(node.meta["val"].shape) for name, node in zip(program.signature.inputs, placeholders)}
    expected = dict(env)
    program.run(expected, {})

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(stage_compiler.ti, "inductor_compile", fails)
    fallback = compile_stage_programs(pipe.compiled, None, torch.device("cuda")).programs[0].forward
    got = dict(env)
    with pytest.warns(UserWarning, match="stage 0's F: Inductor could not compile it .*no kernel for this"):
        fallback.run(got, {})
    for name in program.signature.outputs:
        assert torch.equal(got[name], expected[name])
    strict = compile_stage_programs(pipe.compiled, "inductor", torch.device("cuda")).programs[0].forward
    with pytest.raises(RuntimeError, match="no kernel for this"):
        strict.run(dict(env), {})
