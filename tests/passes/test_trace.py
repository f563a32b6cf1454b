"""`trace_model` on its own: the traced graph computes the model's loss from its parameters,
buffers, inputs and target, placeholders carry their roles and names in the documented order,
in-place buffer updates become outputs, tied weights are one input, and the model is left as it
was."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from helpers.grads import FP32
from helpers.passes import traced, traced_mlp, traced_tied
from zbcompile.passes.trace import ROLE_BUFFER, ROLE_INPUT, ROLE_PARAM, ROLE_TARGET


def _run(case, model: nn.Module | None = None) -> list[torch.Tensor]:
    """The traced graph called on `model`'s (default: the traced model's) own state."""
    model = model or case.model
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    t = case.traced
    return list(
        t.graph_module(*[state[f] for f in t.param_fqns], *[state[f] for f in t.buffer_fqns], case.x, case.target)
    )


def test_traced_graph_computes_the_models_loss():
    case = traced_mlp()
    (loss,) = _run(case)
    torch.testing.assert_close(loss, case.eager_loss(), **FP32)
    # and it is a function of its inputs, not of the values it was traced with
    other = copy.deepcopy(case.model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    (loss_other,) = _run(case, other)
    torch.testing.assert_close(loss_other, F.mse_loss(other(case.x), case.target), **FP32)
    assert not torch.allclose(loss_other, loss)


def test_placeholders_are_parameters_buffers_inputs_then_targets_with_their_names():
    case = traced_mlp()
    t = case.traced
    placeholders = list(t.graph_module.graph.find_nodes(op="placeholder"))
    roles = [n.meta["zb_role"] for n in placeholders]
    assert roles == [ROLE_PARAM] * len(t.param_fqns) + [ROLE_INPUT, ROLE_TARGET]
    assert t.param_fqns == tuple(name for name, _ in case.model.named_parameters())
    assert [n.meta["zb_name"] for n in placeholders] == [*t.param_fqns, "input_0", "target_0"]
    assert [n.meta["zb_name"] for n in t.placeholders(ROLE_PARAM)] == list(t.param_fqns)
    assert t.buffer_fqns == () and t.buffer_updates == ()


def test_buffer_updated_in_place_becomes_an_output_with_the_eager_new_value():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)).train()
    case = traced(model, 6, 4)
    t = case.traced
    assert t.buffer_fqns == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    assert [n.meta["zb_role"] for n in t.graph_module.graph.find_nodes(op="placeholder")][-5:-2] == [ROLE_BUFFER] * 3
    assert set(t.buffer_updates) == set(t.buffer_fqns)
    untouched = {name: b.clone() for name, b in model.named_buffers()}

    loss, *updates = _run(case)

    for name, b in model.named_buffers():  # the traced graph does not write into the buffers
        assert torch.equal(b, untouched[name]), name
    eager = copy.deepcopy(model)
    torch.testing.assert_close(loss, F.mse_loss(eager(case.x), case.target), **FP32)
    new = dict(eager.named_buffers())
    assert len(updates) == len(t.buffer_updates)
    for name, value in zip(t.buffer_updates, updates):
        torch.testing.assert_close(value, new[name], **FP32, msg=lambda m, name=name: f"{name}: {m}")


def test_tied_weight_is_one_input_and_the_model_is_left_as_it_was():
    case = traced_tied()
    t = case.traced
    assert t.param_fqns.count("embed.weight") == 1 and "head.weight" not in t.param_fqns
    assert len(t.placeholders(ROLE_PARAM)) == len(list(case.model.parameters()))
    (loss,) = _run(case)
    torch.testing.assert_close(loss, case.eager_loss(), **FP32)
    assert case.model.head.weight is case.model.embed.weight
    assert all(p.requires_grad and p.grad is None and p.device.type == "cpu" for p in case.model.parameters())
