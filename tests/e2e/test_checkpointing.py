"""Activation checkpointing: `torch.utils.checkpoint(block, x, use_reentrant=False)` regions are
recomputed in the backward instead of saved. A GPT with every block checkpointed gives the
gradients of the same GPT without (bit for bit, every schedule, dropout included); F saves
only the blocks' inputs (M_B drops, measured peaks drop, the recomputation inside the backward
included); each region's forward runs once per I + W, counted; the cost model charges the
recomputation to the backward; the default schedule keeps within 1F1B's memory."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

import zbcompile
from helpers.grads import FP32, assert_grads_close
from zbcompile._torch_internals import TorchDispatchMode
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import Costs, make_schedule, simulate
from zbcompile.schedules.memory_limit import DEFAULT_LIMIT_RULE, default_limit
from zbcompile.schedules.registry import DEFAULT_SCHEDULE, SCHEDULE_NAMES

CONFIG = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=4, dropout=0.1)
BATCH, MICROBATCHES, STAGES = 8, 4, 4
# the tests that read one config's `_pipelines` share an xdist group: `pytest -n` compiles them in one worker
SHARES_GPT4 = pytest.mark.xdist_group("checkpointing-gpt4")
SHARES_GPT12 = pytest.mark.xdist_group("checkpointing-gpt12")


def _batch(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=generator) for _ in range(2))


@functools.lru_cache(maxsize=None)
def _pipelines(config: GPTConfig = CONFIG) -> dict[bool, tuple]:
    """(model, pipe) without and with checkpointing, the same initial weights; one compile each,
    measuring the memory alive inside actions too."""
    result = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(config, checkpoint=checkpointed))
        pipe = zbcompile.pipeline(
            model, stages=STAGES, microbatches=MICROBATCHES, loss_fn=lm_loss, schedule="1f1b", solver_time_budget=0.5
        )
        tokens, target = _batch(config)
        pipe.compile(tokens, target=target)
        pipe.runner.measure_transients()
        result[checkpointed] = (model, pipe)
    return result


def _step(model, pipe, schedule: str, config: GPTConfig = CONFIG, order=None):
    """One step under `schedule` (run in the order of the Schedule `order` where given)."""
    pipe.set_schedule(schedule)
    if order is not None:
        pipe.runner.reschedule(order)
    pipe.zero_grad()
    pipe.runner.reset_peaks()
    torch.manual_seed(7)  # the dropout masks
    tokens, target = _batch(config)
    loss = pipe.step(tokens, target=target)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@SHARES_GPT4
def test_checkpointed_blocks_give_the_same_gradients_bitwise_under_every_schedule():
    """In the order the checkpointed pipeline runs (zb-auto solves a different one for it: its
    default limit); in one process the dropout masks are drawn in that order."""
    pipelines = _pipelines()
    for schedule in SCHEDULE_NAMES:
        loss, grads = _step(*pipelines[True], schedule)
        plain_loss, plain = _step(*pipelines[False], schedule, order=pipelines[True][1].schedule)
        assert torch.equal(loss, plain_loss), schedule
        for fqn, grad in plain.items():
            assert torch.equal(grads[fqn], grad), f"{schedule}: {fqn}"


@functools.lru_cache(maxsize=None)
def _eager(config: GPTConfig, checkpointed: bool) -> tuple[torch.Tensor, dict]:
    """The reference: the same GPT (same initial weights) eager, every block under
    torch.utils.checkpoint or none, as a loop over the microbatches, `(loss / m).backward()` each."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(config, checkpoint=checkpointed))
    losses = []
    for tokens, target in zip(*(t.chunk(MICROBATCHES) for t in _batch(config))):
        loss = lm_loss(model(tokens), target)
        (loss / MICROBATCHES).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}


def _assert_matches(
    loss: torch.Tensor, grads: dict, reference: tuple[torch.Tensor, dict], what: str, **tolerance
) -> None:
    """Bit for bit, or within `tolerance` (the traced embedding backward sums in another order)."""
    torch.testing.assert_close(loss, reference[0], **(tolerance or dict(rtol=0, atol=0)))
    assert_grads_close(grads, reference[1], what, **(tolerance or dict(rtol=0, atol=0)))


@SHARES_GPT12
def test_checkpointed_pipeline_equals_eager_with_and_without_torch_checkpoint():
    """12-layer GPT without dropout: eager with every block under torch.utils.checkpoint and eager
    without it give the same bits; the checkpointed pipeline, under a fused and a split backward,
    gives eager's gradients at fp32 rounding."""
    plain, checkpointed = _eager(GPT12, False), _eager(GPT12, True)
    _assert_matches(*checkpointed, plain, "eager with torch.utils.checkpoint")
    for schedule in ("1f1b", "zb-h1"):
        _assert_matches(
            *_step(*_pipelines(GPT12)[True], schedule, GPT12), checkpointed, f"pipeline, {schedule}", **FP32
        )


@SHARES_GPT4
def test_forward_saves_only_block_inputs_and_the_backward_pays_the_recomputation():
    plain, checkpointed = (_pipelines()[c][1].compiled.programs for c in (False, True))
    for before, after in zip(plain, checkpointed):
        assert after.joint.recomputed and not before.joint.recomputed
        assert after.cost.mem_b <= 0.4 * before.cost.mem_b, (after.index, after.cost.mem_b, before.cost.mem_b)
        assert after.cost.forward.flops == before.cost.forward.flops
        added = _backward_flops(after) - _backward_flops(before)
        assert 0 < added <= after.cost.forward.flops, after.index


def _rank_peak(pipe) -> int:
    """The highest rank's measured peak, what lives inside actions included (one stage per rank
    in these schedules)."""
    return max(e.memory.peak_activation_bytes for e in pipe.executors)


def _predicted_peaks(pipe) -> tuple[float, ...]:
    return simulate(pipe.schedule, pipe.compiled.schedule_costs()).peak_memory


def _backward_flops(program) -> int:
    return program.cost.input_backward.flops + program.cost.weight_backward.flops


@SHARES_GPT4
def test_each_region_runs_its_forward_once_per_input_and_weight_backward():
    """Counted at run time: F computes each block's GELU once per microbatch; the backward of a
    checkpointed block (I and W, or the fused B) computes it once more, never twice."""
    for checkpointed, per_microbatch in ((False, 1), (True, 2)):
        model, pipe = _pipelines()[checkpointed]
        for schedule in ("zb-h1", "1f1b"):
            with _Counting(torch.ops.aten.gelu.default) as count:
                _step(model, pipe, schedule)
            assert count.calls == per_microbatch * CONFIG.layers * MICROBATCHES, (checkpointed, schedule, count.calls)
    for program in _pipelines()[True][1].compiled.programs:
        split = program.split
        names = [n.name for g in (split.input_backward, split.weight_backward) for n in g.graph.graph.nodes]
        assert all(names.count(r) <= 1 for r in program.joint.recomputed), program.index


GPT12 = dataclasses.replace(CONFIG, layers=12, dropout=0.0)


@SHARES_GPT12
def test_measured_peak_activation_bytes_drop_by_40_percent_on_a_12_layer_gpt():
    """1F1B; measured with the recomputed activations that live inside the backward."""
    peaks = {}
    for checkpointed, (model, pipe) in _pipelines(GPT12).items():
        _step(model, pipe, "1f1b", GPT12)
        peaks[checkpointed] = _rank_peak(pipe)
        assert pipe.runner.peak_activation_bytes > pipe.runner.peak_live_bytes  # the backward's transients seen
    assert peaks[True] <= 0.6 * peaks[False], peaks


@SHARES_GPT12
def test_the_default_schedule_gives_checkpointing_its_memory_back():
    """zb-auto with no memory_limit on a model that checkpoints runs under 1F1B's peak per rank
    (`memory_limit.default_limit`): the measured peak is at most 60% of the same GPT's without
    checkpointing under the default schedule, and the predicted peak per rank is 1F1B's at
    most. explain() says which limit it ran under."""
    peaks, predicted = {}, {}
    for checkpointed, (model, pipe) in _pipelines(GPT12).items():
        _step(model, pipe, "1f1b", GPT12)
        one_f_one_b = _predicted_peaks(pipe)
        _step(model, pipe, DEFAULT_SCHEDULE, GPT12)
        peaks[checkpointed], predicted[checkpointed] = _rank_peak(pipe), (_predicted_peaks(pipe), one_f_one_b)
    assert peaks[True] <= 0.6 * peaks[False], peaks
    default, one_f_one_b = predicted[True]
    assert all(d <= b * (1 + 1e-9) for d, b in zip(default, one_f_one_b)), predicted[True]
    plain_default, plain_one_f_one_b = predicted[False]
    assert max(plain_default) > max(plain_one_f_one_b)  # without checkpointing: no limit, W deferred
    assert DEFAULT_LIMIT_RULE in _pipelines(GPT12)[True][1].explain()


def test_zb_auto_always_fits_the_default_limit_and_is_no_slower_than_1f1b():
    """The rule on random costs, M_W up to 12 x M_B (a checkpointed stage's): zb-auto, one stage
    per rank as the pipeline asks without a limit of the user's, finds a schedule within 1F1B's
    per-rank peaks (validated), as fast as 1F1B at least."""
    rng = random.Random(0)
    for _ in range(40):
        p = rng.choice([2, 3, 4, 6])
        m = rng.choice([p, 2 * p, 3 * p + 1])
        draw = lambda low, high: [rng.uniform(low, high) for _ in range(p)]  # noqa: E731
        costs = Costs(
            f=draw(0.5, 2), i=draw(0.5, 2), w=draw(0.2, 2), comm=0.1, mem_b=draw(0.05, 1), mem_w=draw(0.05, 12)
        )
        limit = default_limit(DEFAULT_SCHEDULE, p, m, costs, checkpointed=True)
        schedule = make_schedule(DEFAULT_SCHEDULE, p, m, costs, limit, time_budget=0, placements=("in-line",))
        assert simulate(schedule, costs).span <= simulate(make_schedule("1f1b", p, m), costs).span * (1 + 1e-9)
    assert default_limit(DEFAULT_SCHEDULE, 4, 8, Costs(), checkpointed=False) is None
    assert default_limit("zb-h1", 4, 8, Costs(), checkpointed=True) is None


class _Counting(TorchDispatchMode):
    """Counts the calls of one aten op while active."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def test_reentrant_checkpoint_is_refused_naming_the_module():
    class Reentrant(GPT):
        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1])
            x = self.tok_emb(tokens) + self.pos_emb(positions)
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            return self.head(self.ln_f(x))

    model = Reentrant(dataclasses.replace(CONFIG, layers=2))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss, schedule="1f1b")
    with pytest.raises(
        ValueError, match=r"module '<root>' \(Reentrant\) calls torch.utils.checkpoint with use_reentrant=True"
    ):
        pipe.step(*_batch(CONFIG)[:1], target=_batch(CONFIG)[1])


# --- recompute="auto" ---------------------------------------------------------------------------


@SHARES_GPT12
def test_auto_recompute_fits_a_limit_30_percent_below_zb_h1s_measured_peak():
    """12-layer GPT, zb-h1, the limit in bytes: the measured peak with recompute="auto" stays
    within it, the memory unit stays M_B before recomputation, the gradients are the same bits,
    and explain() says what each stage recomputes."""
    config = GPT12
    model, pipe = _pipelines(config)[False]
    plain_loss, plain = _step(model, pipe, "zb-h1", config)
    peak = _rank_peak(pipe)
    unit = pipe.compiled.memory_unit()
    torch.manual_seed(0)
    auto_model = GPT(config)
    auto = zbcompile.pipeline(
        auto_model,
        stages=STAGES,
        microbatches=MICROBATCHES,
        loss_fn=lm_loss,
        schedule="zb-h1",
        memory_limit=f"{int(0.7 * peak)}B",
        recompute="auto",
    )
    auto.compile(*_batch(config)[:1], target=_batch(config)[1])
    auto.runner.measure_transients()
    loss, grads = _step(auto_model, auto, "zb-h1", config)
    assert _rank_peak(auto) <= 0.7 * peak, ([e.memory.peak_activation_bytes for e in auto.executors], peak)
    assert any(auto.compiled.recompute_levels), auto.compiled.recompute_levels
    assert auto.compiled.memory_unit() == unit
    assert torch.equal(loss, plain_loss) and all(torch.equal(grads[n], g) for n, g in plain.items())
    _assert_matches(loss, grads, _eager(config, False), "recompute='auto' against eager", **FP32)
    text = auto.explain()
    assert all(f"stage {s}: recompute" in text for s in range(STAGES)), text


def test_auto_recompute_needs_a_limit_and_says_when_none_fits():
    with pytest.raises(ValueError, match="memory_limit"):
        zbcompile.pipeline(GPT(CONFIG), stages=2, recompute="auto")
    with pytest.raises(ValueError, match="recompute"):
        zbcompile.pipeline(GPT(CONFIG), stages=2, recompute="always", memory_limit=2)
    pipe = zbcompile.pipeline(
        GPT(CONFIG), stages=2, microbatches=2, loss_fn=lm_loss, schedule="1f1b", memory_limit=0.01, recompute="auto"
    )
    with pytest.raises(ValueError, match=r"stages \[0, 1\] exceed the memory limit at every recompute level"):
        pipe.compile(*_batch(CONFIG)[:1], target=_batch(CONFIG)[1])


def test_auto_recompute_keeps_recomputing_where_that_is_faster_within_the_limit():
    """A schedule solved under the limit (zb-auto) may fit with no recomputation only by giving up
    overlap: the choice goes on to the fitting levels of least simulated time (levels (2, 1)
    here; (2, 2) would be faster still but exceeds the limit)."""
    from zbcompile.compiler import CompiledPipeline
    from zbcompile.runtime.tuning.auto_recompute import Evaluation, choose_recomputation

    def evaluate(candidate: CompiledPipeline) -> Evaluation:
        first, second = candidate.recompute_levels
        over = frozenset({1}) if (first, second) == (2, 2) else frozenset()
        return Evaluation(over, (0.0, 0.0), 10.0 - 2 * (first == 2) - 2 * (second >= 1) - 3 * (second == 2))

    options = (("a0", "a1", "a2"), ("b0", "b1", "b2"))
    compiled = CompiledPipeline(
        None, None, ("a0", "b0"), alternatives=options, recompute_levels=(0, 0), memory_unit_bytes=1
    )
    assert choose_recomputation(compiled, evaluate).recompute_levels == (2, 1)
