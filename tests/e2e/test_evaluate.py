"""`pipe.evaluate()`: the loss computed forward only through the pipeline with the modules in
eval mode (dropout off, BatchNorm's running statistics read, not updated) equals eager
`torch.no_grad()` over the microbatches; gradients, buffers and the modules' modes are left as
they were; `return_outputs` gives the model's outputs for the whole batch; activation memory
stays what the microbatches in flight hold, whatever their number."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zbcompile
from helpers.grads import grads_of

EXACT = dict(rtol=1e-6, atol=1e-7)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(32, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4),
    )


def _batch(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)


@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("zbv", 4)])
def test_evaluate_is_eager_eval_mode_without_touching_the_model(schedule, stages):
    model = _model()
    pipe = zbcompile.pipeline(model, stages=stages, microbatches=4, loss_fn=F.mse_loss, schedule=schedule)
    x, y = _batch()
    pipe.step(x, target=y)  # training statistics and gradients to leave alone
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = grads_of(model)
    loss = pipe.evaluate(x, target=y)
    outputs = pipe.evaluate(x, return_outputs=True)
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        expected = torch.stack([F.mse_loss(reference(a), b) for a, b in zip(x.chunk(4), y.chunk(4))]).mean()
        expected_outputs = reference(x)
    torch.testing.assert_close(loss, expected, **EXACT)
    torch.testing.assert_close(outputs, expected_outputs, **EXACT)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(g, p.grad) for (_, g), p in zip(grads.items(), model.parameters()))


def test_structured_outputs_concatenate_over_microbatches():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> dict:
            h = torch.tanh(self.body(x))
            return {"hidden": h, "out": self.head(h), "scale": None}

    torch.manual_seed(0)
    model = TwoHeads()
    pipe = zbcompile.pipeline(model, stages=2, microbatches=4, loss_fn=lambda out, t: F.mse_loss(out["out"], t))
    x, y = _batch()
    pipe.compile(x, target=y)
    outputs = pipe.evaluate(x, return_outputs=True)
    with torch.no_grad():
        expected = model(x)
    assert outputs.keys() == expected.keys() and outputs["scale"] is None
    for key in ("hidden", "out"):
        torch.testing.assert_close(outputs[key], expected[key], **EXACT)


def test_activation_memory_is_the_microbatches_in_flight_not_their_number():
    """The measured peak inside the forward-only schedule stays within the prediction (each F's
    own peak: nothing is kept between F), and is the same for 2 and 8 microbatches of one size."""
    peaks = {}
    for microbatches in (2, 8):
        pipe = zbcompile.pipeline(_model(), stages=2, microbatches=microbatches, loss_fn=F.mse_loss)
        x, y = _batch(4 * microbatches)
        pipe.compile(x, target=y)
        pipe.evaluate(x, target=y)  # compiles the forward
        runner = pipe.forward_runner
        runner.measure_transients()
        pipe.evaluate(x, target=y)
        per_stage = [e.peak_activation_bytes for e in runner.executors.values()]
        predicted = runner.predicted_peak_bytes()
        assert all(0 < measured <= predicted[s] for s, measured in enumerate(per_stage)), (per_stage, predicted)
        peaks[microbatches] = per_stage
    assert peaks[2] == peaks[8]


class MeanLossIgnoringItemCount(nn.Module):
    """Computes its own mean loss from `labels` and takes any keyword (as transformers'
    classifiers do, so the pipeline passes `num_items_in_batch`), reading neither the count nor
    `unused`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, unused: torch.Tensor, labels: torch.Tensor, **kwargs) -> dict:
        logits = self.b(torch.tanh(self.a(x)))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_a_model_loss_that_ignores_the_item_count_is_the_mean_and_unread_inputs_cost_nothing():
    """The model's own loss ignores `num_items_in_batch`: evaluate() gives the mean of the
    microbatch losses, as step() does and as eager computes it; a batch input no stage reads
    (`unused`, and the count) is not held by a stage, so the measured peak stays within the
    prediction."""
    model = MeanLossIgnoringItemCount()
    g = torch.Generator().manual_seed(1)
    x, unused, labels = (
        torch.randn(16, 8, generator=g),
        torch.randn(16, 64, generator=g),
        torch.randint(0, 3, (16,), generator=g),
    )
    pipe = zbcompile.pipeline(model, stages=2, microbatches=4)
    trained = pipe.step(x, unused=unused, labels=labels)
    pipe.evaluate(x, unused=unused, labels=labels)
    runner = pipe.forward_runner
    runner.measure_transients()
    loss = pipe.evaluate(x, unused=unused, labels=labels)
    with torch.no_grad():
        expected = torch.stack(
            [F.cross_entropy(model.b(torch.tanh(model.a(a))), b) for a, b in zip(x.chunk(4), labels.chunk(4))]
        ).mean()
    torch.testing.assert_close(loss, expected, **EXACT)
    torch.testing.assert_close(trained, expected, **EXACT)
    per_stage = [e.peak_activation_bytes for e in runner.executors.values()]
    predicted = runner.predicted_peak_bytes()
    assert all(0 < measured <= predicted[s] for s, measured in enumerate(per_stage)), (per_stage, predicted)


def test_evaluate_before_any_compile_says_what_to_do():
    pipe = zbcompile.pipeline(_model(), stages=2, microbatches=4, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError, match=r"compiles on the first step\(\) or compile\(\)"):
        pipe.evaluate(*_batch())
