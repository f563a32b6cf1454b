"""Every recompute level keeps the gradients: on every zoo model and a plain nn.Module Llama
(RMSNorm written out, rotary embeddings computed in the forward from `arange`, SwiGLU MLP, untied
head), each stage at each level of `RECOMPUTE_LEVELS` gives gradients bitwise equal to the
pipeline without recomputation, under a split-backward schedule (I and W) and a fused one (B);
those equal the eager model's within fp32 tolerance."""

from __future__ import annotations

import functools

import pytest
import torch

import zbcompile
from helpers.grads import FP32, assert_grads_close, grads_of
from helpers.models import NAMES, build
from zbcompile.compiler import compile_pipeline
from zbcompile.passes.recompute import RECOMPUTE_LEVELS
from zbcompile.runtime.parallel import batch
from zbcompile.runtime.step.local import LocalRunner
from zbcompile.runtime.tuning.auto_recompute import with_levels
from zbcompile.schedules import make_schedule
from zbcompile.value_names import buffer_name, param_name

STAGES, MICROBATCHES = 2, 2
SCHEDULES = ("zb-h1", "1f1b")
# the tests that read the Llama's `_compiled_with_levels` share an xdist group: `pytest -n` compiles it once
SHARES_LLAMA = pytest.mark.xdist_group("recompute-levels-llama")


@functools.lru_cache(maxsize=None)
def _compiled_with_levels(name: str):
    """The case, its microbatches and its compile with every stage at every recompute level."""
    case = build(name)
    micro_inputs, micro_targets, _ = batch.split(case.args, case.kwargs, case.target, MICROBATCHES)
    (args, kwargs), target = micro_inputs[0], micro_targets[0]
    compiled = compile_pipeline(case.model, case.loss_fn, args, kwargs, target, STAGES, recompute_alternatives=True)
    return case, compiled, batch.feeds(compiled, micro_inputs, micro_targets)


def _grads_at(name: str, level: int, schedule_name: str) -> dict[str, torch.Tensor]:
    """One step with every stage at `level` (0: no recomputation), its gradients by FQN."""
    case, compiled, feeds = _compiled_with_levels(name)
    state = {param_name(n): p for n, p in case.model.named_parameters()}
    state.update({buffer_name(n): b for n, b in case.model.named_buffers()})
    runner = LocalRunner(
        with_levels(compiled, [level] * STAGES), make_schedule(schedule_name, STAGES, MICROBATCHES), state
    )
    runner.step(*feeds)
    return runner.reduce_grads()


def _levels_that_differ(schedule_name: str) -> list[int]:
    """Every level under a split backward; under the fused one (B), which runs the backward as
    separated, one level per recompute predicate (the levels' other choices concern I and W)."""
    if schedule_name == "zb-h1":
        return list(range(len(RECOMPUTE_LEVELS) + 1))
    first = {}
    for level, options in enumerate(RECOMPUTE_LEVELS, start=1):
        first.setdefault(options.recompute, level)
    return [0, *first.values()]


@pytest.mark.parametrize("name", [*NAMES, pytest.param("llama", marks=SHARES_LLAMA)])
def test_every_recompute_level_keeps_the_gradients_bitwise(name):
    case = build(name)
    eager_model = build(name).model
    case.eager_loss(eager_model).backward()
    eager = grads_of(eager_model)
    plain = zbcompile.pipeline(case.model, stages=STAGES, microbatches=MICROBATCHES, loss_fn=case.loss_fn)
    for schedule_name in SCHEDULES:
        plain.set_schedule(schedule_name).zero_grad()
        case.step(plain)
        expected = grads_of(case.model)
        assert_grads_close(expected, eager, f"{name}, {schedule_name}, no recomputation, against eager", **FP32)
        for level in _levels_that_differ(schedule_name):
            grads = _grads_at(name, level, schedule_name)
            what = f"{name}, {schedule_name}, level {level} ({RECOMPUTE_LEVELS[level - 1].name if level else 'none'})"
            assert set(grads) == set(expected), what
            for fqn, grad in expected.items():
                assert torch.equal(grads[fqn], grad), f"{what}: {fqn}"


@SHARES_LLAMA
def test_the_llama_style_model_recomputes_at_the_higher_levels():
    """The levels the test above runs do recompute on the Llama-style model (the test can fail)."""
    _, compiled, _ = _compiled_with_levels("llama")
    assert all(len(options) == len(RECOMPUTE_LEVELS) + 1 for options in compiled.alternatives)
    for options in compiled.alternatives:
        assert not options[0].joint.recomputed
        assert all(p.joint.recomputed for p in options[1:])
