"""`partition_stages` on its own: the requested number of contiguous stages that together hold
every forward node that depends on the inputs exactly once, neighbour-to-neighbour boundaries,
stage modules that chained compute the model's loss, split points that start the stage they
name, tied weights shared by the stages that use them, and clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from helpers.grads import FP32
from helpers.passes import traced_mlp, traced_tied
from zbcompile.passes.partition import StagePartition, partition_stages
from zbcompile.passes.trace import ROLE_INPUT, ROLE_TARGET


def _anchored(graph: fx.Graph) -> list[str]:
    """Computed nodes that depend on a model input or the target, in graph order."""
    anchored: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta["zb_role"] in (ROLE_INPUT, ROLE_TARGET):
            anchored.add(node)
        elif node.op == "call_function" and any(a in anchored for a in node.all_input_nodes):
            anchored.add(node)
    return [n.name for n in graph.nodes if n in anchored and n.op == "call_function"]


def _chained_loss(case, partition: StagePartition) -> torch.Tensor:
    """Run the stage modules one after the other on the model's own parameters (the modules hold
    fake ones), each reading its boundary values (and the target) by name."""
    env = {"input_0": case.x, "target_0": case.target}
    params = dict(case.model.named_parameters())
    for stage in partition.stages:
        state = {path: params[fqn] for path, fqn in stage.state_fqns.items()}
        results = torch.func.functional_call(stage.module, state, tuple(env[name] for name in stage.graph_inputs))
        env.update(zip(stage.graph_outputs, results))
    return env[partition.stages[-1].graph_outputs[0]]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_anchored_node_is_in_one_stage_in_graph_order(stages):
    case = traced_mlp()
    partition = partition_stages(case.traced, stages)
    assert [s.index for s in partition.stages] == list(range(stages))
    anchored = _anchored(case.traced.graph_module.graph)
    assert sorted(partition.stage_of_node) == sorted(anchored)
    order = [partition.stage_of_node[name] for name in anchored]
    assert order == sorted(order) and set(order) == set(range(stages)), order  # contiguous, none empty
    assert list(partition.cuts) == [i for i in range(1, len(order)) if order[i] != order[i - 1]]
    computed = [{n.name for n in s.module.graph.nodes if n.op == "call_function"} for s in partition.stages]
    for name in anchored:  # computed by the one stage it is assigned to, and by no other
        assert [s for s, names in enumerate(computed) if name in names] == [partition.stage_of_node[name]], name


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_chained_compute_the_loss_over_neighbour_boundaries(stages):
    case = traced_mlp()
    partition = partition_stages(case.traced, stages)
    first, last = partition.stages[0], partition.stages[-1]
    assert first.inputs == ("input_0",) and last.outputs == () and "target_0" in last.graph_inputs
    for before, after in zip(partition.stages, partition.stages[1:]):
        assert after.inputs == before.outputs, (before.index, before.outputs, after.inputs)
        assert partition.boundary_bytes[before.index] == sum(partition.values[v].nbytes for v in before.outputs)
    owned = [f for s in partition.stages for f in s.param_fqns]
    assert sorted(owned) == sorted(case.traced.param_fqns) and partition.shared_params == {}
    torch.testing.assert_close(_chained_loss(case, partition), case.eager_loss(), **FP32)


def test_split_points_start_the_stages_they_name():
    case = traced_mlp()
    partition = partition_stages(case.traced, 3, ["fc2", "fc4"])
    assert [s.param_fqns for s in partition.stages] == [
        ("fc1.weight", "fc1.bias"),
        ("fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"),
        ("fc4.weight", "fc4.bias"),
    ]
    torch.testing.assert_close(_chained_loss(case, partition), case.eager_loss(), **FP32)
    # the cut positions reproduce the partition
    again = partition_stages(case.traced, 3, cuts=partition.cuts)
    assert [s.param_fqns for s in again.stages] == [s.param_fqns for s in partition.stages]


def test_tied_weight_is_shared_by_the_stages_that_use_it():
    case = traced_tied()
    partition = partition_stages(case.traced, 3, ["middle", "head"])
    assert partition.shared_params == {"embed.weight": (0, 2)}
    assert "embed.weight" in partition.stages[0].param_fqns and "embed.weight" in partition.stages[2].param_fqns
    assert "embed.weight" not in partition.stages[1].param_fqns
    torch.testing.assert_close(_chained_loss(case, partition), case.eager_loss(), **FP32)


def test_refusals_name_what_to_change():
    traced = traced_mlp().traced
    with pytest.raises(ValueError, match="stages must be at least 1"):
        partition_stages(traced, 0)
    with pytest.raises(ValueError, match="ask for fewer stages"):
        partition_stages(traced, 64)
    with pytest.raises(ValueError, match="pass 1 split points"):
        partition_stages(traced, 2, ["fc2", "fc3"])
    with pytest.raises(ValueError, match="split point 'decoder' names no module"):
        partition_stages(traced, 2, ["decoder"])
    with pytest.raises(ValueError, match="does not come after the previous split point"):
        partition_stages(traced, 3, ["fc3", "fc2"])
