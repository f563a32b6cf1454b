"""Post-validation in one process and the rollbacks on their own: the clip coefficient is
torch's, each rollback restores parameters and optimizer state (bit for bit with "exact"), and
what cannot be undone is refused with a clear error."""

from __future__ import annotations

import pytest
import torch

import zbcompile
from helpers.models import build
from zbcompile.runtime.state.optimizer import (
    NormState,
    chain_sum,
    clip_coefficient,
    squared_norm,
)
from zbcompile.runtime.state.rollback import ExactRollback, ReverseRollback, make_rollback


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=what)


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


@pytest.mark.parametrize("max_norm, skip_nonfinite", [(None, True), (None, False), (0.3, False)])
def test_optimizer_options_against_torch_in_one_process(max_norm, skip_nonfinite):
    """Against the inner optimizer driven by hand, torch's clipping where max_norm is given (bit
    for bit without it, within rtol 1e-6 with it), over 3 steps, the second with an Inf in one
    gradient: max_norm=None steps unclipped; skip_nonfinite=True skips the Inf step (parameters and
    optimizer state untouched), skip_nonfinite=False takes it as torch would (non-finite results);
    with neither, nothing is validated."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, schedule="zb-h1")
    initial = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    finals, records = {}, None
    for wrapped in (True, False):
        with torch.no_grad():
            for n, p in pipe.named_parameters():
                p.copy_(initial[n])
        inner = torch.optim.AdamW(pipe.parameters(), lr=0.05)
        opt = (
            zbcompile.PostValidatedOptimizer(inner, pipe, max_norm=max_norm, skip_nonfinite=skip_nonfinite)
            if wrapped
            else None
        )
        for step in range(3):
            case.step(pipe)
            if step == 1:
                next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
            if opt is not None:
                opt.step()
            elif not (step == 1 and skip_nonfinite):
                if max_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(pipe.parameters()), max_norm)
                inner.step()
            pipe.zero_grad()
        if opt is not None:
            opt.close()
            records = opt.history
        finals[wrapped] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    if max_norm is None and not skip_nonfinite:  # nothing to validate: the inner optimizer's steps
        assert records == []
    else:
        assert [r.skipped for r in records] == [False, skip_nonfinite, False], records
        assert all(not r.clipped for r in records) if max_norm is None else records[1].clipped
    finite = all(v.isfinite().all() for v in finals[True].values())
    assert finite is skip_nonfinite
    for n, value in finals[True].items():
        expected = finals[False][n]
        if max_norm is None:
            assert torch.equal(value.nan_to_num(), expected.nan_to_num()), n
        else:
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7, equal_nan=True, msg=n)


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
    "sgd-dampening-wd-maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.02, maximize=True
    ),
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
                (torch.testing.assert_close if mode == "reverse" else _assert_equal)(
                    p.detach(), a, rtol=1e-6, atol=1e-7
                )
            for key, state in before_state.items():
                for k, v in state.items():
                    (torch.testing.assert_close if mode == "reverse" else _assert_equal)(
                        after_state[key][k], v, rtol=1e-5, atol=1e-7
                    )
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
    bf16 = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, 2, dtype=torch.bfloat16))]
    with pytest.raises(
        ValueError, match=r'torch.bfloat16 parameters \(param group 0, e.g. one of shape \(3, 2\)\).*rollback="exact"'
    ):
        ReverseRollback(torch.optim.AdamW(bf16))
    make_rollback(torch.optim.AdamW(bf16), "exact")  # a snapshot restores any dtype bit for bit
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn)
    with pytest.raises(ValueError, match="max_norm"):
        zbcompile.PostValidatedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), pipe, max_norm=-1.0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zbcompile.PostValidatedOptimizer(object(), pipe)
