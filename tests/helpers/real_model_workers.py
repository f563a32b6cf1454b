"""What each rank runs in the multi-process tests of third-party models (importable by spawned
processes), and the eager training they are compared with."""

from __future__ import annotations

import torch

import zbcompile
from helpers.distributed_workers import make_optimizer
from helpers.real_models import MICROBATCHES, NAMES, build

# (model, stages, schedule) on 2 ranks: GPT-2 and Llama one stage per rank, or two (zbv); every
# other family of `real_models` one stage per rank under zb-h1
RUNS = [(name, stages, schedule) for name in ("gpt2", "llama") for stages, schedule in ((2, "1f1b"), (2, "zb-h1"), (4, "zbv"))] + [
    (name, 2, "zb-h1") for name in NAMES if name not in ("gpt2", "llama")
]
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
        results[(name, stages, schedule)] = {**first, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}
    return results


def eager_training(name: str) -> dict[str, torch.Tensor]:
    """The state dict after `STEPS` eager AdamW steps on the whole batch."""
    case = build(name)
    optimizer = make_optimizer("adamw", case.model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        case.eager_loss().backward()
        optimizer.step()
    return case.model.state_dict()
