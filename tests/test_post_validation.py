"""Optimizer post-validation: global gradient clipping and non-finite skipping without a barrier
before the optimizer step, with exact and reverse rollback.

Multi-process runs (gloo, GPT with its tied embedding, zb-h1): for SGD with momentum, Adam and
AdamW over 10 steps, post-validated training equals a synchronous reference (bitwise with
rollback="exact" against the one that sums the norm in the same order; within rtol 1e-6 of the
one built on torch.nn.utils' clipping, and with rollback="reverse"). An Inf injected into one
rank's gradients leaves every rank's parameters and optimizer state bitwise unchanged."""

from __future__ import annotations

import functools

import post_validation_workers as workers
import pytest
import torch
from models import build
from multiprocess import run_ranks

import zbcompile
from zbcompile.runtime.optimizer import (
    NormState,
    chain_sum,
    clip_coefficient,
    squared_norm,
)
from zbcompile.runtime.rollback import ExactRollback, ReverseRollback, make_rollback

OPTIMIZERS = ("sgd", "adam", "adamw")


# --- multi-process equivalence -------------------------------------------------------------------


@functools.cache
def _launch(world: int) -> list[dict]:
    """2 ranks: a 2-stage pipeline. 4 ranks: a 4-stage pipeline, then 2 replicas x 2 stages."""
    if world == 2:
        pipelines = [(2, OPTIMIZERS)]
    else:
        pipelines = [(4, OPTIMIZERS), (2, ("adamw",))]
    return run_ranks(world, workers.train_all, pipelines)


@pytest.fixture(params=[(2, 2), (4, 4), (4, 2)], ids=["2ranks", "4ranks", "2replicas-x-2stages"])
def launch(request):
    world, stages = request.param
    return stages, _launch(world)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within rtol 1e-6, elementwise and relative to the tensor's largest element (a moment
    that sums gradients of both signs can be near 0 where its terms are not)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=what)


def _compare(result: dict, reference: dict, what: str, bitwise: bool) -> None:
    assert result["params"].keys() == reference["params"].keys(), what
    assert result["state"].keys() == reference["state"].keys(), what
    pairs = [(f"param {n}", result["params"][n], reference["params"][n]) for n in reference["params"]]
    for n, state in reference["state"].items():
        assert result["state"][n].keys() == state.keys(), f"{what}: state of {n}"
        pairs += [(f"state {n}.{k}", result["state"][n][k], v) for k, v in state.items()]
    for name, actual, expected in pairs:
        if bitwise:
            assert torch.equal(actual, expected), f"{what}: {name} differs"
        else:
            _close(actual, expected, f"{what}: {name}")


def _optimizers(per_rank: list[dict], stages: int) -> list[str]:
    return sorted({k[1] for k in per_rank[0] if k[0] == stages and k[1] != "layout"})


@pytest.mark.xdist_group("distributed")
def test_exact_rollback_is_bitwise_equal_to_the_synchronous_reference(launch):
    stages, per_rank = launch
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            for fault in (False, True):
                _compare(result[(stages, name, "exact", fault)], result[(stages, name, "sync", fault)], f"rank {rank} {name} fault={fault}", True)


@pytest.mark.xdist_group("distributed")
def test_within_rtol_1e6_of_torch_clipping_and_with_reverse_rollback(launch):
    stages, per_rank = launch
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            sync = result[(stages, name, "sync", False)]
            _compare(result[(stages, name, "exact", False)], result[(stages, name, "torch", False)], f"rank {rank} {name} exact vs torch", False)
            _compare(result[(stages, name, "reverse", False)], sync, f"rank {rank} {name} reverse", False)
            if (stages, name, "reverse", True) in result:
                _compare(result[(stages, name, "reverse", True)], result[(stages, name, "sync", True)], f"rank {rank} {name} reverse+fault", False)


@pytest.mark.xdist_group("distributed")
def test_clipping_happens_on_some_steps_and_the_norm_counts_each_parameter_once(launch):
    stages, per_rank = launch
    for name in _optimizers(per_rank, stages):
        histories = [r[(stages, name, "exact", False)]["history"] for r in per_rank]
        assert all(h == histories[0] for h in histories), f"{name}: ranks disagree on the verdicts"
        clipped = [c for _, c, _ in histories[0]]
        assert len(clipped) == workers.STEPS and any(clipped) and not all(clipped), f"{name}: {clipped}"
        # the tied embedding counted once, as torch's norm over every distinct parameter does
        torch_norms = [n for n, _, _ in per_rank[0][(stages, name, "torch", False)]["history"]]
        for ours, theirs in zip([n for n, _, _ in histories[0]], torch_norms):
            assert ours == pytest.approx(theirs, rel=1e-6), name
    layouts = [r[(stages, "layout")] for r in per_rank]
    assert all(layout["tied_owner"] for layout in layouts if layout["pp_rank"] in (0, stages - 1))


@pytest.mark.xdist_group("distributed")
def test_an_inf_in_one_ranks_gradients_changes_nothing_anywhere(launch):
    stages, per_rank = launch
    fault_rank = stages // 2 - 1
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            run = result[(stages, name, "exact", True)]
            before, after = run["around_fault"]
            _compare(after, before, f"rank {rank} {name}: the step with an Inf", True)
            assert run["history"][workers.FAULT_STEP][2], f"{name}: the step was not skipped"
            if result[(stages, "layout")]["pp_rank"] > fault_rank:  # stepped optimistically, then undid it
                assert run["rollbacks"] >= 1
            steps = [int(s["step"].item()) for s in after["state"].values() if "step" in s]
            assert all(s == workers.FAULT_STEP for s in steps), steps  # the skipped step is not counted


@pytest.mark.xdist_group("distributed")
def test_replicas_and_tied_copies_stay_identical(launch):
    stages, per_rank = launch
    for name in _optimizers(per_rank, stages):
        final = [r[(stages, name, "exact", False)]["params"] for r in per_rank]
        layouts = [r[(stages, "layout")] for r in per_rank]
        for a, la in zip(final, layouts):
            for b, lb in zip(final, layouts):
                for n in a.keys() & b.keys():  # the same parameter held by two ranks
                    assert torch.equal(a[n], b[n]), f"{name}: {n} differs between ranks {la} and {lb}"
        if len(per_rank) > stages:
            assert final[0].keys() == final[stages].keys()


@pytest.mark.xdist_group("distributed")
def test_an_unvalidated_step_is_never_exposed_by_state_dict(launch):
    stages, per_rank = launch
    for result in per_rank:
        said = result[(stages, "adamw", "exact", False)]["refusals"]
        assert len(said) == 2 and all("opt.finish()" in s for s in said), said


# --- one process ---------------------------------------------------------------------------------


def test_in_one_process_the_global_state_is_applied_at_once():
    """One process (LocalRunner): the global state is known at once; equal to the synchronous
    variant bit for bit and to torch's clip_grad_norm_ within rtol 1e-6."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, schedule="zb-h1")
    initial = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    finals, histories = {}, {}
    for wrapper in ("post", "sync", "torch"):
        with torch.no_grad():
            for n, p in pipe.named_parameters():
                p.copy_(initial[n])
        inner = torch.optim.AdamW(pipe.parameters(), lr=0.05)
        opt = {"post": zbcompile.PostValidatedOptimizer, "sync": zbcompile.SynchronousClipOptimizer}.get(wrapper)
        opt = opt(inner, pipe, max_norm=0.3) if opt else None
        for _ in range(4):
            case.step(pipe)
            if opt is None:
                torch.nn.utils.clip_grad_norm_(list(pipe.parameters()), 0.3)
                inner.step()
            else:
                opt.step()
            pipe.zero_grad()
        if wrapper == "post":
            opt.close()
        finals[wrapper] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        histories[wrapper] = opt.history if opt else None
    assert any(r.clipped for r in histories["post"]) and histories["post"] == histories["sync"]
    for n, value in finals["post"].items():
        assert torch.equal(value, finals["sync"][n]), n
        _close(value, finals["torch"][n], n)


def test_clip_coefficient_is_torchs():
    grads = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    state = squared_norm(grads)
    assert state.sumsq**0.5 == pytest.approx(norm.item(), rel=1e-6)
    coef = clip_coefficient(state, 0.5)
    for p, g in zip(params, grads):
        _close(g * coef, p.grad, "clipped gradient")
    assert clip_coefficient(state, 1e6) is None
    assert clip_coefficient(state, None) is None
    assert squared_norm([torch.tensor([1.0, float("inf")])]).nonfinite
    assert chain_sum([NormState(1.0), NormState(2.0, True), NormState(4.0)]) == NormState(7.0, True)


# --- rollback ------------------------------------------------------------------------------------

ROLLBACK_CASES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-dampening-wd-maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.02, maximize=True),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-wd": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, maximize=True),
}


def _state_copy(optimizer: torch.optim.Optimizer) -> dict:
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}


@pytest.mark.parametrize("mode", ["exact", "reverse"])
@pytest.mark.parametrize("name", sorted(ROLLBACK_CASES))
def test_rollback_restores_parameters_and_state(name, mode):
    """Undo the first step (the state disappears) and the fourth (the state steps back)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
    optimizer = ROLLBACK_CASES[name](params)
    rollback = make_rollback(optimizer, mode)
    for step in range(4):
        for p in params:
            p.grad = torch.randn_like(p)
        before_params = [p.detach().clone() for p in params]
        before_state = _state_copy(optimizer)
        if step in (0, 3):
            rollback.prepare()
            optimizer.step()
            assert not all(torch.equal(a, p) for a, p in zip(before_params, params))
            rollback.undo({p: p.grad for p in params})
            after_state = _state_copy(optimizer)
            assert after_state.keys() == before_state.keys(), f"{name}: state after undo of step {step}"
            for a, p in zip(before_params, params):
                (torch.testing.assert_close if mode == "reverse" else _assert_equal)(p.detach(), a, rtol=1e-6, atol=1e-7)
            for key, state in before_state.items():
                for k, v in state.items():
                    (torch.testing.assert_close if mode == "reverse" else _assert_equal)(after_state[key][k], v, rtol=1e-5, atol=1e-7)
        optimizer.step()


def _assert_equal(actual, expected, **_):
    assert torch.equal(actual, expected)


def test_exact_rollback_reports_its_memory():
    params = [torch.nn.Parameter(torch.randn(10))]
    optimizer = torch.optim.Adam(params)
    rollback = ExactRollback(optimizer)
    params[0].grad = torch.ones(10)
    optimizer.step()
    rollback.prepare()
    # the parameter, exp_avg, exp_avg_sq (float32) and the step counter
    assert rollback.held_bytes == 3 * 10 * 4 + 4
    rollback.discard()
    assert rollback.held_bytes == 0


def test_reverse_rollback_refuses_what_it_cannot_undo():
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(TypeError, match=r'RMSprop.*rollback="exact"'):
        ReverseRollback(torch.optim.RMSprop(params))
    with pytest.raises(ValueError, match="amsgrad"):
        ReverseRollback(torch.optim.Adam(params, amsgrad=True))
    with pytest.raises(ValueError, match='"exact" or "reverse"'):
        make_rollback(torch.optim.Adam(params), "undo")
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    with pytest.raises(ValueError, match="max_norm"):
        zbcompile.PostValidatedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), pipe, max_norm=-1.0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zbcompile.PostValidatedOptimizer(object(), pipe)
