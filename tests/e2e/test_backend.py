"""The torch.compile backend "zbcompile": deferred weight gradients equal eager's once run, the
deferred backward runs no weight-gradient matmul, graph breaks and shared weights, and the
backend is found through its entry point without importing zbcompile."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from zbcompile import _torch_internals as ti
from zbcompile.backend import defer_weight_grads

aten = torch.ops.aten
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    """Distinct sizes everywhere, so a matmul's output shape tells which gradient it computes."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 12)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        if self.graph_break:
            ti.graph_break()
        return self.fc2(h)


class SharedWeight(nn.Module):
    """One Linear applied twice in one region."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).mean()


def _eager_reference(model: nn.Module, x: torch.Tensor):
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_()
    _loss(reference, x_ref).backward()
    return reference, x_ref


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _inputs(seed: int = 0, features: int = 6) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(5, features, requires_grad=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("graph_break", [False, True], ids=["one_region", "graph_break"])
def test_deferred_backward_then_run_equals_eager(graph_break):
    torch.manual_seed(0)
    model = Net(graph_break)
    x = _inputs()
    reference, x_ref = _eager_reference(model, x)
    compiled = torch.compile(model, backend="zbcompile")
    with defer_weight_grads() as store:
        _loss(compiled, x).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
        assert all(p.grad is None for p in model.parameters()), "B must leave every .grad untouched"
        assert len(store) == (2 if graph_break else 1)
        if graph_break:  # backward order: the second region's W first
            first, second = store.pending_parameters()
            assert {id(p) for p in first} == {id(p) for p in model.fc2.parameters()}
            assert {id(p) for p in second} == {id(p) for p in [*model.fc1.parameters(), *model.norm.parameters()]}
        store.run()
        assert len(store) == 0
        _assert_grads_equal(model, reference)


def test_shared_weight_used_twice_in_one_region():
    torch.manual_seed(0)
    model = SharedWeight()
    x = _inputs(features=7)
    reference, x_ref = _eager_reference(model, x)
    with defer_weight_grads() as store:
        _loss(torch.compile(model, backend="zbcompile"), x).backward()
        assert model.fc.weight.grad is None and len(store) == 1
        store.run()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    _assert_grads_equal(model, reference)


def test_grads_accumulate_into_existing_grad_and_leaving_the_block_runs_w():
    torch.manual_seed(0)
    model = Net()
    x = _inputs()
    reference, _ = _eager_reference(model, x)
    _loss(reference, x.detach()).backward()  # a second backward accumulates
    compiled = torch.compile(model, backend="zbcompile")
    _loss(compiled, x.detach()).backward()  # outside a block: the complete backward
    assert all(p.grad is not None for p in model.parameters())
    with defer_weight_grads():
        _loss(compiled, x).backward()
    _assert_grads_equal(model, reference)


def test_an_exception_in_the_block_drops_the_queued_w():
    model = Net()
    compiled = torch.compile(model, backend="zbcompile")
    with pytest.raises(RuntimeError, match="stop"):
        with defer_weight_grads() as store:
            _loss(compiled, _inputs()).backward()
            raise RuntimeError("stop")
    assert len(store) == 0
    assert all(p.grad is None for p in model.parameters())


class _RecordMatmuls(ti.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (aten.mm, aten.addmm, aten.bmm, aten.matmul, aten.linear):
            self.shapes.append(tuple(out.shape))
        return out


def _weight_matmuls(model: nn.Module, shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    weights = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
    weights |= {s[::-1] for s in weights}
    return [s for s in shapes if s in weights]


def test_deferred_backward_runs_no_weight_gradient_matmul():
    model = Net()
    compiled = torch.compile(model, backend="zbcompile")
    x = _inputs()
    unsplit = _RecordMatmuls()
    loss = _loss(compiled, x)
    with unsplit:
        loss.backward()  # outside a block: the weight-gradient matmuls run (the check can fail)
    assert len(_weight_matmuls(model, unsplit.shapes)) == 2

    deferred, later = _RecordMatmuls(), _RecordMatmuls()
    loss = _loss(compiled, x)
    with defer_weight_grads() as store:
        with deferred:
            loss.backward()
        with later:
            store.run()
    assert deferred.shapes, "B computes the input gradients with matmuls"
    assert _weight_matmuls(model, deferred.shapes) == []
    assert len(_weight_matmuls(model, later.shapes)) == 2


def test_entry_point_finds_the_backend_without_importing_zbcompile():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("zbcompile") == "zbcompile.backend:zbcompile_backend", (
        "the zbcompile distribution's metadata lacks the torch_dynamo_backends entry point; reinstall it "
        "(pip install -e .) so that pyproject.toml's entry points are recorded"
    )
    script = textwrap.dedent(
        """
        import copy, sys
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        reference = copy.deepcopy(model)
        x = torch.randn(5, 4)
        assert "zbcompile" not in sys.modules
        (torch.compile(model, backend="zbcompile")(x) ** 2).sum().backward()
        (reference(x) ** 2).sum().backward()
        assert "zbcompile.backend" in sys.modules
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_dynamic_shapes():
    """With symbolic sizes the backward reads saved SymInts before the saved tensors; every
    weight gradient goes to W (no concrete sizes to weigh the cheap ones by)."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="zbcompile", dynamic=True)
    for batch in (5, 7):
        x = torch.randn(batch, 6, requires_grad=True)
        with defer_weight_grads() as store:
            _loss(compiled, x).backward()
            assert len(store) == 1 and all(p.grad is None for p in model.parameters())
            store.run()
        _loss(reference, x.detach()).backward()
        _assert_grads_equal(model, reference)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
