"""What each rank runs in the multi-process tests of third-party models (importable by spawned
processes), and the eager training they are compared with."""

from __future__ import annotations

import torch

import zbcompile
from helpers.distributed_workers import make_optimizer
from helpers.real_models import MICROBATCHES, NAMES, build

# (model, stages, schedule) on 2 ranks: GPT-2 and Llama one stage per rank, or two (zbv); every
# other family of `real_models` one stage per rank under zb-h1
RUNS = [
    (name, stages, schedule)
    for name in ("gpt2", "llama")
    for stages, schedule in ((2, "1f1b"), (2, "zb-h1"), (4, "zbv"))
] + [(name, 2, "zb-h1") for name in NAMES if name not in ("gpt2", "llama")]
STEPS = 2


def meta_train(runs: list[tuple[str, int, str]]) -> dict:
    """For each run: the model built on the meta device, this rank's parameters filled from the
    eager model's full state dict, then `STEPS` AdamW steps. Returns per run the first step's
    loss (None off the last stage) and this rank's gradients, and this rank's state dict after
    the last step. Consecutive runs of one model and stage count share a compile."""
    results = {}
    pipe, previous = None, None
    for name, stages, schedule in runs:
        full_state = build(name).model.state_dict()
        if (name, stages) != previous:
            case = build(name, meta=True)
            pipe = zbcompile.pipeline(
                case.model, stages=stages, microbatches=MICROBATCHES, loss_fn=case.loss_fn, schedule=schedule,
                init_fn=case.model._init_weights, timeout=60,
            )
            pipe.compile(*case.args, target=case.target, **case.kwargs)
            previous = (name, stages)
        else:
            pipe.set_schedule(schedule)
        pipe.load_state_dict(full_state)
        optimizer = make_optimizer("adamw", pipe.parameters())
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = case.step(pipe)
            if step == 0:
                first = {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}
            optimizer.step()
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        evaluation = _evaluate(pipe, case)
        if schedule == "zb-h1":  # the model's outputs, once per model
            evaluation["logits"] = _logits(
                pipe.evaluate(*case.args, return_outputs=True, use_cache=False, **case.kwargs)
            )
        results[(name, stages, schedule)] = {**first, "state": state, "evaluation": evaluation}
    return results


def _evaluate(pipe, case) -> dict:
    """`pipe.evaluate()` on the case's batch, twice (the second measuring activation memory):
    the loss (None off the last stage), whether every gradient was left as it was, and this
    rank's measured and predicted peak activation bytes."""
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.evaluate(*case.args, target=case.target, **case.kwargs)
    pipe.forward_runner.measure_transients()
    loss = pipe.evaluate(*case.args, target=case.target, **case.kwargs)
    runner = pipe.forward_runner
    return {
        "loss": loss,
        "grads_kept": all(torch.equal(p.grad, grads[n]) for n, p in pipe.named_parameters()),
        "peak": runner.peak_activation_bytes,
        "predicted": runner.predicted_peak_bytes()[pipe.runner.layout.pp_rank],
    }


def _logits(output) -> torch.Tensor | None:
    return None if output is None else output.logits


def eager_logits(name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of the model holding `state` on the whole batch, in eval mode."""
    case = build(name)
    case.model.load_state_dict(state)
    with torch.no_grad():
        return case.model.eval()(*case.args, **case.kwargs).logits


def eager_evaluation(name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of the model holding `state`, in eval mode under torch.no_grad(), over the
    microbatches: for a model whose loss reads `num_items_in_batch` (its loss on a microbatch
    changes when given the batch's count of labels other than -100, shifted in a decoder-only
    model), the sum of the microbatches' shares of the batch's loss; for any other, the mean of
    their losses."""
    case = build(name)
    case.model.load_state_dict(state)
    case.model.eval()
    chunks = lambda value: value.chunk(MICROBATCHES) if value is not None else [None] * MICROBATCHES  # noqa: E731
    args = list(zip(*[chunks(a) for a in case.args])) or [()] * MICROBATCHES
    kwargs = [dict(zip(case.kwargs, values)) for values in zip(*[chunks(v) for v in case.kwargs.values()])] or [
        {}
    ] * MICROBATCHES
    with torch.no_grad():
        if case.loss_fn is not None:
            return torch.stack(
                [case.loss_fn(case.model(*a, **k), t) for a, k, t in zip(args, kwargs, chunks(case.target))]
            ).mean()
        labels = case.kwargs["labels"]
        items = ((labels if case.model.config.is_encoder_decoder else labels[..., 1:]) != -100).sum()
        means = [case.model(*a, **k).loss for a, k in zip(args, kwargs)]
        shares = [case.model(*a, **k, num_items_in_batch=items).loss for a, k in zip(args, kwargs)]
        if torch.equal(torch.stack(means), torch.stack(shares)):  # the model's loss ignores the count
            return torch.stack(means).mean()
        return sum(shares)


def eager_training(name: str) -> dict[str, torch.Tensor]:
    """The state dict after `STEPS` eager AdamW steps on the whole batch."""
    case = build(name)
    optimizer = make_optimizer("adamw", case.model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        case.eager_loss().backward()
        optimizer.step()
    return case.model.state_dict()
