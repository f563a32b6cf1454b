"""`export_stage_joints` on its own: per stage, the forward F and the backward are pure functions
over named values; F chained over the stages computes the loss, and the backwards chained in
reverse (each stage's `tangent:` being the next stage's `grad:`) give the parameter gradients
autograd gives for the whole model; a tied weight's gradient is the sum of its stages'."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from helpers.grads import FP32, assert_grads_close
from helpers.passes import traced_mlp, traced_tied
from zbcompile.passes.joint import StageJoint, export_stage_joints, extract_program
from zbcompile.passes.partition import StagePartition, partition_stages
from zbcompile.value_names import (
    OUTPUT,
    PARAM,
    SAVED,
    fqn_of,
    grad_name,
    input_name,
    is_input_grad,
    output_name,
    param_grad_name,
    param_name,
    tangent_name,
)


def _run_joints(
    case, partition: StagePartition, joints: tuple[StageJoint, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One microbatch through the joints: every F in stage order, then every backward in reverse.
    Returns the loss and the parameter gradients (summed over the stages sharing a weight)."""
    state = {param_name(fqn): p.detach() for fqn, p in case.model.named_parameters()}
    boundary = {"input_0": case.x, "target_0": case.target}
    envs = []
    for stage, joint in zip(partition.stages, joints):
        env = {input_name(v): boundary[v] for v in (*stage.inputs, *stage.graph_inputs) if v in boundary}
        joint.forward.run(env, state)
        boundary.update({fqn_of(name): value for name, value in env.items() if name.startswith(OUTPUT)})
        envs.append(env)
    loss = envs[-1][output_name("loss")]
    grads_from_next = {"loss": torch.ones_like(loss)}
    param_grads: dict[str, torch.Tensor] = {}
    for joint, env in reversed(list(zip(joints, envs))):
        env.update({tangent_name(v): grads_from_next[v] for v in joint.tangents})
        joint.backward.run(env, state)
        grads_from_next = {fqn_of(name): value for name, value in env.items() if is_input_grad(name)}
        for fqn in joint.param_grads:
            grad = env[param_grad_name(fqn)]
            param_grads[fqn] = param_grads[fqn] + grad if fqn in param_grads else grad
    return loss, param_grads


def _eager(case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = case.eager_loss()
    loss.backward()
    grads = {fqn: p.grad.clone() for fqn, p in case.model.named_parameters()}
    case.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_joints_chained_give_the_loss_and_autograds_gradients(stages):
    case = traced_mlp()
    partition = partition_stages(case.traced, stages)
    joints = export_stage_joints(partition, case.traced.fake_mode)
    assert [j.stage for j in joints] == list(range(stages))

    loss, grads = _run_joints(case, partition, joints)

    eager_loss, eager_grads = _eager(case)
    torch.testing.assert_close(loss, eager_loss, **FP32)
    assert_grads_close({f: grads[f] for f in eager_grads}, eager_grads, f"{stages} stages", **FP32)


def test_signatures_follow_the_calling_convention():
    case = traced_mlp()
    partition = partition_stages(case.traced, 3)
    joints = export_stage_joints(partition, case.traced.fake_mode)
    for stage, joint in zip(partition.stages, joints):
        forward, backward = joint.forward.signature, joint.backward.signature
        last = stage.index == len(partition.stages) - 1
        outputs = tuple(output_name(v) for v in (("loss",) if last else stage.outputs))
        assert forward.outputs[: len(outputs)] == outputs, forward.outputs
        assert all(n.startswith(SAVED) for n in forward.outputs[len(outputs) :]), forward.outputs
        assert {n for n in forward.inputs if n.startswith(PARAM)} == {param_name(f) for f in stage.param_fqns}
        assert joint.tangents == (("loss",) if last else stage.outputs)
        assert joint.output_grads == (() if last else stage.outputs)
        assert {tangent_name(v) for v in joint.tangents} <= set(backward.inputs)
        assert set(backward.outputs) == {grad_name(v) for v in joint.input_grads} | {
            param_grad_name(f) for f in joint.param_grads
        }
        assert set(joint.param_grads) == set(stage.param_fqns)
        # the model's input needs no gradient; every boundary value after it does
        assert joint.input_grads == (() if stage.index == 0 else stage.inputs)


def test_tied_weight_gradient_is_the_sum_over_its_stages():
    case = traced_tied()
    partition = partition_stages(case.traced, 3, ["middle", "head"])
    joints = export_stage_joints(partition, case.traced.fake_mode)
    assert "embed.weight" in joints[0].param_grads and "embed.weight" in joints[2].param_grads

    loss, grads = _run_joints(case, partition, joints)

    eager_loss, eager_grads = _eager(case)
    torch.testing.assert_close(loss, eager_loss, **FP32)
    assert_grads_close({f: grads[f] for f in eager_grads}, eager_grads, "tied weight over 3 stages", **FP32)


def test_extracted_programs_keep_their_nodes_names_when_an_input_is_named_like_one():
    """An input whose environment name reads like a body node's name (`in:add`, a stage input
    that the previous stage's graph called `add`) takes another name: the node keeps its own, by
    which later passes find it (the values a backward recomputes), and the graph compiles."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    add = graph.call_function(torch.ops.aten.add.Tensor, (x, y), name="add")
    add_1 = graph.call_function(torch.ops.aten.mul.Tensor, (add, y), name="add_1")
    graph.output((add_1,))
    program = extract_program(graph, {add, add_1}, [x, y], [(add_1, "out:z")], {x: "in:add", y: "in:add_1"}, "P")
    nodes = {n.name: n.op for n in program.graph.graph.nodes}
    assert nodes["add"] == nodes["add_1"] == "call_function", nodes
    assert program.signature.inputs == ("in:add", "in:add_1")
    env = {"in:add": torch.tensor([1.0]), "in:add_1": torch.tensor([3.0])}
    program.run(env, {})
    assert env["out:z"].item() == 12.0
