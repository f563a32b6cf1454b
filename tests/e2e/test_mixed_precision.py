"""bf16 mixed precision: a Llama under `torch.autocast(bf16)` and one cast to bf16 give, under
every schedule, the loss and gradients of an eager loop over the microbatches bit for bit in
one process and on 2 ranks (within bf16 tolerance for dualpipe, which adds its two copies'
sums); autocast's casts are in the traced graph;
`grad_dtype=torch.float32` accumulates as eager autograd does with `param.grad_dtype`; boundary
messages carry the traced dtypes; post-validated clipping works on bf16 gradients."""

from __future__ import annotations

import pytest
import torch

import zbcompile
from helpers import launches
from helpers import precision_workers as workers
from helpers.real_models import MICROBATCHES
from zbcompile.schedules.registry import SCHEDULE_NAMES, schedule_spec

BF16 = dict(rtol=2e-2, atol=2e-3)


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for fqn, grad in expected.items():
        assert actual[fqn].dtype == grad.dtype, f"{what}: {fqn}: {actual[fqn].dtype} != {grad.dtype}"
        assert torch.equal(actual[fqn], grad), (
            f"{what}: {fqn} differs by {(actual[fqn].float() - grad.float()).abs().max()}"
        )


@pytest.mark.parametrize("mode", workers.MODES)
def test_every_schedule_equals_eager_microbatches_bitwise_in_one_process(mode):
    reference = workers.llama(mode)
    eager_loss, eager_grads = workers.eager_microbatches(reference)
    case = workers.llama(mode)
    pipe = zbcompile.pipeline(case.model, stages=4, microbatches=MICROBATCHES, schedule="1f1b", solver_time_budget=0.5)
    for name in SCHEDULE_NAMES:
        pipe.set_schedule(name)
        pipe.zero_grad()
        loss = case.step(pipe)
        assert torch.equal(loss, eager_loss), f"{mode} {name}: loss {loss} != {eager_loss}"
        grads = {n: p.grad for n, p in case.model.named_parameters()}
        if schedule_spec(name).mirrored:
            _check_close(grads, eager_grads, f"{mode} {name}")
        else:
            _assert_equal(grads, eager_grads, f"{mode} {name}")


def test_autocast_casts_are_in_the_traced_graph_and_boundaries_carry_their_dtypes():
    case = workers.llama("autocast")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=MICROBATCHES, schedule="1f1b")
    case.step(pipe)
    compiled = pipe.compiled
    graph = compiled.traced.graph_module.graph
    matmuls = [
        n
        for n in graph.nodes
        if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    ]
    assert matmuls and all(n.meta["val"].dtype == torch.bfloat16 for n in matmuls), "autocast runs matmuls in bf16"
    casts = [
        n
        for n in graph.nodes
        if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == torch.bfloat16
    ]
    assert casts, "the fp32 weights are cast to bf16 in the graph"
    assert all(p.dtype == torch.float32 for p in case.model.parameters())
    boundary = compiled.partition.stages[0].outputs
    dtypes = {compiled.partition.values[v].dtype for v in boundary}
    assert torch.bfloat16 in dtypes, f"the hidden state crosses the boundary in bf16, got {dtypes}"


def test_grad_dtype_float32_accumulates_like_eager_autograd_with_param_grad_dtype():
    reference = workers.llama("bf16")
    eager_loss, eager_grads = workers.eager_microbatches(reference, grad_dtype=torch.float32)
    plain_loss, plain_grads = workers.eager_microbatches(workers.llama("bf16"))
    case = workers.llama("bf16")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=MICROBATCHES, schedule="zb-h1", grad_dtype=torch.float32
    )
    for schedule in ("zb-h1", "1f1b"):  # split and fused backward
        pipe.set_schedule(schedule)
        pipe.zero_grad()
        assert torch.equal(case.step(pipe), eager_loss)
        grads = {n: p.grad for n, p in case.model.named_parameters()}
        _assert_equal(grads, eager_grads, f"grad_dtype=float32 {schedule}")
    assert all(p.dtype == torch.bfloat16 for p in case.model.parameters())
    assert any(not torch.equal(g.bfloat16(), plain_grads[n]) for n, g in grads.items()), (
        "fp32 accumulation rounds differently"
    )
    case.step(pipe)  # a second step adds to .grad, in fp32
    assert all(p.grad.dtype == torch.float32 for p in case.model.parameters())


def test_grad_dtype_must_be_a_floating_dtype():
    with pytest.raises(TypeError, match="grad_dtype"):
        zbcompile.pipeline(torch.nn.Linear(2, 2), stages=1, grad_dtype=torch.int32)


@launches.READS_TWO_RANK_MODELS
def test_two_ranks_every_schedule_grad_dtype_and_post_validation_in_bf16():
    per_rank = launches.two_rank_results("precision")  # the shared two-rank launch
    references = {mode: workers.eager_microbatches(workers.llama(mode)) for mode in workers.MODES}
    keys = [k for k in per_rank[0] if isinstance(k, tuple)]
    assert {name for _, name in keys} == set(SCHEDULE_NAMES)
    for key in keys:
        eager_loss, eager_grads = references[key[0]]
        _check_against(per_rank, key, eager_loss, eager_grads, str(key), bitwise=not schedule_spec(key[1]).mirrored)
    eager_loss, eager_grads = workers.eager_microbatches(workers.llama("bf16"), grad_dtype=torch.float32)
    _check_against(per_rank, "grad_dtype", eager_loss, eager_grads, "grad_dtype", bitwise=True)
    assert all(g.dtype == torch.float32 for r in per_rank for g in r["grad_dtype"]["grads"].values())
    bf16_accumulated = {n: g.float() for n, g in references["bf16"][1].items()}
    with pytest.raises(AssertionError):  # the check above tells bf16 accumulation from fp32
        _assert_equal(bf16_accumulated, eager_grads, "bf16 accumulation")
    for rank in per_rank:
        exact, sync = rank["post_validation"]["exact"], rank["post_validation"]["sync"]
        clipped = [c for _, c, _ in exact["history"]]
        assert any(clipped) and not all(clipped), exact["history"]
        assert exact["history"] == sync["history"]
        for name, value in sync["params"].items():
            assert value.dtype == torch.bfloat16
            assert torch.equal(exact["params"][name], value), name


def _check_against(per_rank: list, key, eager_loss: torch.Tensor, eager_grads: dict, what: str, bitwise: bool) -> None:
    """Bit for bit, or within bf16 tolerance where the schedule adds two copies' sums (dualpipe)."""
    losses = [r[key]["loss"] for r in per_rank if r[key]["loss"] is not None]
    assert len(losses) == 1, what
    grads = {n: g for r in per_rank for n, g in r[key]["grads"].items()}
    if bitwise:
        assert torch.equal(losses[0], eager_loss), f"{what}: loss {losses[0]} != {eager_loss}"
        _assert_equal(grads, eager_grads, what)
    else:
        torch.testing.assert_close(losses[0], eager_loss, **BF16, msg=lambda m: f"{what}: {m}")
        _check_close(grads, eager_grads, what)


def _check_close(grads: dict, eager_grads: dict, what: str) -> None:
    assert grads.keys() == eager_grads.keys(), what
    for fqn, grad in eager_grads.items():
        assert grads[fqn].dtype == grad.dtype, f"{what}: {fqn}"
        torch.testing.assert_close(grads[fqn], grad, **BF16, msg=lambda m, fqn=fqn: f"{what}: {fqn}: {m}")
