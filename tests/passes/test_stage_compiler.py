"""compiler="inductor": every stage's F, B and W run as Inductor-generated code and the step's
gradients equal eager's within fp32 tolerance (one small case: Inductor compiles slowly on CPU);
compiler="traced" (the default on CPU): the recorded ops compute eager's bits, every schedule
alike, and leave the RNG where eager leaves it; a graph the tracer cannot take runs op by op."""

from __future__ import annotations

import copy
import dataclasses
import operator

import pytest
import torch
from torch import nn

import zbcompile
from helpers.models import GPT_CONFIG, build
from zbcompile.models.gpt import GPT
from zbcompile.passes.program import Signature
from zbcompile.runtime.step import stage_compiler
from zbcompile.runtime.step.stage_compiler import InductorProgram, TracedProgram, compile_stage_programs


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


def test_default_compiler_is_inductor_with_a_fallback_on_cuda_and_traced_elsewhere():
    pipe, _, _ = _compiled_mlp()
    on_cpu = compile_stage_programs(pipe.compiled, None, torch.device("cpu"))
    assert all(isinstance(p.forward, TracedProgram) for p in on_cpu.programs)
    assert compile_stage_programs(pipe.compiled, "eager", torch.device("cpu")) is pipe.compiled
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


def _trained(compiler: str, schedule: str) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The loss and gradients of one pipelined step of the zoo's GPT with dropout, and the RNG
    state after."""
    case = build("gpt")
    model = GPT(dataclasses.replace(GPT_CONFIG, dropout=0.1))
    options = dict(stages=2, microbatches=2, loss_fn=case.loss_fn, schedule=schedule, compiler=compiler)
    pipe = zbcompile.pipeline(model, **options)
    torch.manual_seed(7)
    loss = case.step(pipe)
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}, torch.get_rng_state()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_traced_programs_compute_eager_bits_and_leave_the_rng_alone(schedule):
    """A GPT (dropout on: its masks come from the RNG), one step: the same loss and gradients,
    bit for bit, as its graphs run op by op, under a fused and a split backward; the RNG ends
    where eager's does (recording ran the graphs once more, on the side)."""
    loss, grads, rng = _trained("eager", schedule)
    traced_loss, traced_grads, traced_rng = _trained("traced", schedule)
    assert torch.equal(loss, traced_loss)
    assert grads.keys() == traced_grads.keys()
    assert all(torch.equal(grads[n], traced_grads[n]) for n in grads)
    assert torch.equal(rng, traced_rng)


def test_traced_programs_record_once_and_a_graph_of_other_ops_runs_op_by_op(monkeypatch):
    pipe, x, target = _compiled_mlp()
    program = compile_stage_programs(pipe.compiled, "traced", torch.device("cpu")).programs[0].forward
    placeholders = program.graph.graph.find_nodes(op="placeholder")
    env = {name: torch.randn(node.meta["val"].shape) for name, node in zip(program.signature.inputs, placeholders)}
    expected = dict(env)
    pipe.compiled.programs[0].forward.run(expected, {})
    for _ in range(2):
        got = dict(env)
        program.run(got, {})
        assert all(torch.equal(got[n], expected[n]) for n in program.signature.outputs)
    assert isinstance(program._traced["fn"], torch.jit.ScriptFunction)  # recorded on the first run, kept

    refused = TracedProgram(program.graph, program.signature)
    monkeypatch.setattr(stage_compiler.ti, "traced", lambda gm, inputs: None)
    got = dict(env)
    refused.run(got, {}, consumed=[program.signature.inputs[-1]])  # op by op: the consumed input freed
    assert refused._traced["fn"] is False and program.signature.inputs[-1] not in got
    assert all(torch.equal(got[n], expected[n]) for n in program.signature.outputs)


def test_a_shape_generic_graph_is_scripted_once_and_runs_every_size():
    """A graph of symbolic sizes (its sizes are int inputs) is compiled by TorchScript on its first
    run and computes, at every size, the bits the graph computes op by op."""
    graph = torch.fx.Graph()
    x, size = graph.placeholder("x"), graph.placeholder("size")
    x.meta["val"], size.meta["val"] = torch.empty(0), 0  # what the trace records: a tensor, a size
    doubled = graph.call_function(operator.mul, (size, 2))
    flat = graph.call_function(torch.ops.aten.view.default, (x, [doubled, -1]))
    graph.output((graph.call_function(torch.ops.aten.softmax.int, (flat, -1)), doubled))
    graph_module = torch.fx.GraphModule({}, graph)
    program = TracedProgram(graph_module, Signature(("in:x", "in:size"), ("out:y", "out:rows")))
    for length in (3, 5, 3, 7):
        x = torch.randn(length, 2, 4)
        env = {"in:x": x, "in:size": length}
        program.run(env, {})
        y, rows = graph_module(x, length)
        assert torch.equal(env["out:y"], y) and env["out:rows"] == rows == 2 * length
    assert isinstance(program._traced["fn"], torch.jit.ScriptModule)


def test_only_graphs_of_aten_ops_are_recorded():
    """A graph that calls anything but aten ops (a collective: recording would run it once more
    on this rank than on its peers) is left to run op by op."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.sin.default, (x,)),))
    plain = torch.fx.GraphModule({}, graph)
    assert stage_compiler.ti.traced(plain, [torch.randn(3)]) is not None
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,)),))
    assert stage_compiler.ti.traced(torch.fx.GraphModule({}, graph), [torch.randn(3)]) is None
