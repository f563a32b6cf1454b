"""The whole batch's loss: with labels padded to different lengths per row, so that microbatches
hold different numbers of valid labels, a step's gradient equals eager full-batch training
(not the mean of microbatch means) through a `(loss_sum, count)` loss_fn and through a
transformers model's own loss (the pipeline passes `num_items_in_batch`), bitwise across
schedules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import zbcompile
from helpers.grads import FP32, assert_grads_close, grads_of

transformers.logging.set_verbosity_error()

VOCAB, BATCH, SEQ, MICROBATCHES = 32, 8, 6, 4
SCHEDULES = ("1f1b", "zb-h1", "zb-h2")
VALID = (1, 6, 2, 5, 3, 6, 4, 0)  # valid labels per row: 7, 7, 9 and 4 per microbatch (shifted: 5, 5, 7, 3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for row, valid in enumerate(VALID):
        labels[row, valid:] = -100
    return ids, labels


def _token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), (labels != -100).sum()


def _steps(pipe, model: nn.Module, *args, **kwargs) -> tuple[dict, torch.Tensor]:
    """One step per schedule on the same compile: the gradients (bitwise equal across schedules)
    and the loss."""
    grads = {}
    for schedule in SCHEDULES:
        pipe.set_schedule(schedule)
        pipe.zero_grad()
        loss = pipe.step(*args, **kwargs)
        grads[schedule] = grads_of(model)
    for schedule, other in grads.items():
        assert all(torch.equal(grads[SCHEDULES[0]][n], other[n]) for n in other), (
            f"{schedule} differs from {SCHEDULES[0]}"
        )
    return grads[SCHEDULES[0]], loss


def _assert_not_close(actual: dict, expected: dict) -> None:
    """The reference the test tells apart: some gradient differs beyond the tolerance."""
    assert any(not torch.allclose(actual[n], g, **FP32) for n, g in expected.items())


def test_loss_sum_and_count_train_as_eager_full_batch():
    ids, labels = _batch()
    model = _token_model()
    reference, per_microbatch = copy.deepcopy(model), copy.deepcopy(model)
    eager = F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten())
    eager.backward()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=MICROBATCHES, loss_fn=summed_cross_entropy)
    grads, loss = _steps(pipe, model, ids, target=labels)
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads, grads_of(reference), "(loss_sum, count)", **FP32)
    means = [
        F.cross_entropy(per_microbatch(i).flatten(0, 1), t.flatten()) for i, t in zip(ids.chunk(4), labels.chunk(4))
    ]
    torch.stack(means).mean().backward()
    _assert_not_close(grads, grads_of(per_microbatch))


def test_transformers_model_gets_the_batch_label_count():
    """GPT-2 with `labels`: its causal loss shifts them, so the count is of labels[..., 1:]."""
    ids, labels = _batch()
    model = _gpt2()
    reference, per_microbatch = copy.deepcopy(model), copy.deepcopy(model)
    eager = reference(ids, labels=labels).loss
    eager.backward()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=MICROBATCHES)
    grads, loss = _steps(pipe, model, ids, labels=labels)
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads, grads_of(reference), "GPT-2 num_items_in_batch", **FP32)
    means = [per_microbatch(i, labels=t).loss for i, t in zip(ids.chunk(4), labels.chunk(4))]
    torch.stack(means).mean().backward()
    _assert_not_close(grads, grads_of(per_microbatch))


class _IgnoresItemCount(nn.Module):
    """Accepts **kwargs (so it is passed num_items_in_batch) but averages per microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), labels)


def test_a_model_that_ignores_the_count_keeps_the_mean_of_microbatch_means():
    torch.manual_seed(0)
    model = _IgnoresItemCount()
    reference = copy.deepcopy(model)
    x, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = zbcompile.pipeline(model, stages=2, microbatches=MICROBATCHES)
    loss = pipe.step(x, labels=labels)
    eager = torch.stack([reference(a, b) for a, b in zip(x.chunk(4), labels.chunk(4))]).mean()
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), **FP32)
    assert_grads_close(grads_of(model), grads_of(reference), "mean of means", **FP32)


def test_a_count_read_from_the_output_is_refused():
    pipe = zbcompile.pipeline(
        _token_model(),
        stages=2,
        microbatches=MICROBATCHES,
        loss_fn=lambda out, t: (out.sum(), out.shape[0] + out.sum()),
    )
    with pytest.raises(ValueError, match=r"count must come from the target alone"):
        pipe.step(*_batch()[:1], target=_batch()[1])


def test_num_items_in_batch_given_by_the_user_is_refused():
    ids, labels = _batch()
    pipe = zbcompile.pipeline(_gpt2(), stages=2, microbatches=MICROBATCHES)
    with pytest.raises(ValueError, match=r"got num_items_in_batch=; the pipeline passes it itself"):
        pipe.step(ids, labels=labels, num_items_in_batch=5)
