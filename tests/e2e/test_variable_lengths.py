"""Sequence lengths that change step to step: by default the second length compiles once more with
symbolic sizes, and every later length runs on that compile; gradients equal eager's at every
length, under every schedule, in one process and on two gloo ranks (`runtime/compile_cache.py`,
`passes/shape_symbols.py`)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import zbcompile
from helpers import launches
from helpers.distributed_workers import VARIABLE_LENGTHS, variable_length_batch
from helpers.grads import FP32, assert_grads_close, grads_of
from helpers.models import build
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import simulate


def eager_step(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, microbatches: int):
    """The mean of the microbatch losses and its gradients, on `model` (its gradients zeroed first)."""
    model.zero_grad()
    pairs = zip(tokens.chunk(microbatches), target.chunk(microbatches))
    loss = sum(lm_loss(model(t), y) for t, y in pairs) / microbatches
    loss.backward()
    return loss.detach(), grads_of(model)


class Block(nn.Module):
    """Pre-norm causal self-attention (nn.MultiheadAttention, its mask made from the length) and an MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attention = nn.MultiheadAttention(hidden, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, length = self.norm1(x), x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), 1)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(64, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_one_shape_generic_compile_serves_every_later_length():
    """The first length compiles for its shape, the second shape-generically (the sequence
    dimension symbolic), and every later length, shorter or longer, runs on that compile with
    eager's loss and gradients. Four layers: each stage's joint is stitched from its blocks'
    (`passes/block_joint.py`), symbolic sizes read in each."""
    torch.manual_seed(0)
    model = Decoder()
    eager = copy.deepcopy(model)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss, schedule="zb-h1")
    compiles = []
    for length in VARIABLE_LENGTHS:
        tokens, target = variable_length_batch(length)
        loss = pipe.step(tokens, target=target)
        expected_loss, expected = eager_step(eager, tokens, target, 2)
        torch.testing.assert_close(loss, expected_loss, **FP32)
        assert_grads_close(grads_of(pipe), expected, f"length {length}", **FP32)
        pipe.zero_grad()
        compiles.append(pipe.compiled)
    assert compiles[0].traced.symbols is None
    generic = compiles[1]
    assert [d.leaf for d in generic.traced.symbols.symbolic()] == ["input_0", "target_0"]
    first_length = VARIABLE_LENGTHS[0]
    for length, compiled in zip(VARIABLE_LENGTHS[1:], compiles[1:]):  # the first length keeps its own
        assert compiled is (compiles[0] if length == first_length else generic), f"length {length} compiled again"
    assert "input_0[1]" in pipe.explain()


def test_evaluation_serves_every_later_length_from_one_forward_compile():
    case = build("llama")
    eager = copy.deepcopy(case.model).eval()
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=lm_loss, schedule="1f1b")
    pipe.step(*variable_length_batch(8)[:1], target=variable_length_batch(8)[1])
    pipe.eval()
    runners = []
    for length in (9, 14, 6, 21):
        tokens, target = variable_length_batch(length)
        with torch.no_grad():
            expected = sum(lm_loss(eager(t), y) for t, y in zip(tokens.chunk(2), target.chunk(2))) / 2
        torch.testing.assert_close(pipe.evaluate(tokens, target=target), expected, **FP32)
        runners.append(pipe.forward_runner)
    assert runners[0].compiled.traced.symbols is None
    assert runners[1].compiled.traced.symbols is not None
    assert all(r is runners[1] for r in runners[2:]), "a later length compiled its forward again"


def test_gradients_bitwise_equal_across_schedules_at_every_length():
    """`dynamic=1`: symbolic from the first compile; each schedule computes the same bits at every
    length (the schedule changes when work runs, never what it computes)."""
    grads: dict[str, list] = {}
    for schedule in ("1f1b", "zb-h1", "zb-h2", "zb-auto"):
        case = build("llama")
        pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=lm_loss, schedule=schedule, dynamic=1)
        grads[schedule] = []
        for length in (6, 11, 17):
            tokens, target = variable_length_batch(length)
            pipe.step(torch.cat([tokens, tokens]), target=torch.cat([target, target]))
            grads[schedule].append(grads_of(pipe))
            pipe.zero_grad()
        assert pipe.compiled.traced.symbols is not None
    reference = grads.pop("1f1b")
    for schedule, per_length in grads.items():
        for expected, actual in zip(reference, per_length):
            for fqn, grad in expected.items():
                assert torch.equal(actual[fqn], grad), f"{schedule}: {fqn}"


class StepByStep(nn.Module):
    """A recurrence over positions in a Python loop: its trace unrolls one iteration per position,
    so the sequence length cannot stay a symbol."""

    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        state, outputs = torch.zeros_like(x[:, 0]), []
        for position in range(x.shape[1]):
            state = torch.tanh(self.cell(torch.cat([x[:, position], state], dim=-1)))
            outputs.append(state)
        return self.head(torch.stack(outputs, dim=1))


def test_a_length_the_trace_must_fix_compiles_per_shape_with_one_warning():
    torch.manual_seed(0)
    model = StepByStep()
    eager = copy.deepcopy(model)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss, schedule="1f1b")
    caught = []
    for length in (4, 6, 5):
        tokens, target = variable_length_batch(length)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = pipe.step(tokens, target=target)
        caught += [str(w.message) for w in seen if "zbcompile" in str(w.message)]
        expected_loss, expected = eager_step(eager, tokens, target, 2)
        torch.testing.assert_close(loss, expected_loss, **FP32)
        assert_grads_close(grads_of(pipe), expected, f"length {length}", **FP32)
        pipe.zero_grad()
        assert pipe.compiled.traced.symbols is None
    assert len(caught) == 1, caught
    assert "input_0[1]" in caught[0] and "dynamic=False" in caught[0], caught[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamic_false_compiles_per_shape_and_true_symbolic_from_the_first(dynamic):
    """`dynamic=False`: a compile per shape, none symbolic; `dynamic=True`: every dimension of the
    inputs and targets symbolic from the first compile, a new batch size and length included."""
    torch.manual_seed(0)
    model = Decoder(layers=2)
    eager = copy.deepcopy(model)
    pipe = zbcompile.pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss, schedule="1f1b", dynamic=dynamic)
    compiles = []
    for rows, length in ((4, 8), (4, 12), (8, 10)):
        tokens, target = variable_length_batch(length)
        tokens, target = tokens[:rows], target[:rows]
        torch.testing.assert_close(pipe.step(tokens, target=target), eager_step(eager, tokens, target, 2)[0], **FP32)
        compiles.append(pipe.compiled)
    if dynamic:
        assert all(c is compiles[0] for c in compiles)
        symbolic = {(d.leaf, d.dim) for d in compiles[0].traced.symbols.symbolic()}
        assert {("input_0", 0), ("input_0", 1)} <= symbolic, symbolic
    else:
        assert len({id(c) for c in compiles}) == 3 and all(c.traced.symbols is None for c in compiles)


def test_a_longer_length_runs_a_schedule_within_a_memory_limit_in_bytes():
    """zb-auto's schedule fits `memory_limit` (bytes) at the traced length; at three times that
    length each microbatch keeps over three times the activations (more than any schedule keeping
    two microbatches in flight has room for), and the step runs a schedule
    solved to fit the same bytes there (the loss still eager's); at the traced length the first
    schedule runs again. At eight times the length nothing fits, even one microbatch at a time: a
    ValueError says so."""
    torch.manual_seed(0)
    model = Decoder(layers=2)
    eager = copy.deepcopy(model)
    probe = zbcompile.pipeline(copy.deepcopy(model), stages=2, microbatches=4, loss_fn=lm_loss, dynamic=1)
    probe.compile(*variable_length_batch(8)[:1], target=variable_length_batch(8)[1])
    limit = 6 * probe.compiled.memory_unit()  # bytes: room for 6 microbatches' activations at length 8
    pipe = zbcompile.pipeline(model, stages=2, microbatches=4, loss_fn=lm_loss, dynamic=1, memory_limit=f"{limit:.0f}B")
    for length in (8, 24, 8):
        tokens, target = variable_length_batch(length)
        torch.testing.assert_close(pipe.step(tokens, target=target), eager_step(eager, tokens, target, 4)[0], **FP32)
    steps = pipe._builder.cache.steps  # the labels of the schedules run, by the step's sizes ("s3=24")
    short, long = (next(by for sizes, by in steps.items() if sizes.endswith(f"={n}")) for n in (8, 24))
    assert list(short.values()) == [2] and not any("fits" in label for label in short), steps
    assert any("x the activations" in label for label in long), steps
    compiled = pipe.compiled
    for power, schedule in pipe._builder._fitting[pipe._builder._last_key].items():
        peaks = simulate(schedule, compiled.schedule_costs()).peak_memory  # at the traced length
        assert max(peaks) * compiled.memory_unit() * power <= limit, (power, peaks)
    with pytest.raises(ValueError, match="no schedule fits memory_limit"):
        pipe.step(*variable_length_batch(64)[:1], target=variable_length_batch(64)[1])


def test_the_dynamic_option_is_checked():
    with pytest.raises(ValueError, match="dynamic must be None"):
        zbcompile.pipeline(nn.Linear(2, 2), stages=1, dynamic="sequence")


@launches.READS_TWO_RANKS
def test_two_ranks_run_every_length_on_one_compile_with_eager_gradients():
    """Default options (zb-auto measuring its costs and racing its cut) on two gloo ranks, each
    passing only what its stages read after the first step: every new length after the first on
    the shape-generic compile, each step's loss and gradients eager's."""
    per_rank = launches.two_rank_results("variable_lengths")
    eager = build("llama").model
    for index, length in enumerate(VARIABLE_LENGTHS):
        steps = [r["steps"][index] for r in per_rank]
        generic = index >= 1 and length != VARIABLE_LENGTHS[0]  # the first length keeps its own compile
        assert all(s["generic"] == generic for s in steps), (length, [s["generic"] for s in steps])
        tokens, target = variable_length_batch(length)
        expected_loss, expected = eager_step(eager, tokens, target, 2)
        losses = [s["loss"] for s in steps if s["loss"] is not None]
        assert len(losses) == 1, length
        torch.testing.assert_close(losses[0], expected_loss, **FP32)
        grads = {fqn: g for s in steps for fqn, g in s["grads"].items()}
        assert_grads_close({n: grads.get(n) for n in expected}, expected, f"length {length}", **FP32)
