"""The step's loss over the whole batch, and the gradient each microbatch's loss gets.

A batch's loss is made of its microbatches' losses in one of three ways (README.md, "The whole
batch's loss"):

- "mean" (a loss that is a microbatch's mean): the mean of the microbatch losses; each gets 1/m.
- "sum/count" (`loss_fn` returns `(loss_sum, count)`, `passes/loss_parts.py`): the whole batch's
  sum(loss_sum) / sum(count), N = sum(count) over every microbatch of every data-parallel replica,
  counted before the step by the ranks holding the last stage (from the targets alone); each
  loss_sum gets 1/N.
- "share" (no `loss_fn`; the model computes its own loss from `labels` and reads
  `num_items_in_batch`, as transformers' language models do): the pipeline passes the batch's
  count N of labels other than -100 (after the model's shift where its loss shifts them, as
  transformers' Trainer counts), so each microbatch's loss is its share sum/N of the batch's;
  each gets 1, and the batch's loss is their sum.

Replicas: `DistributedRunner.reduce_grads` averages gradients over the data-parallel replicas,
so a microbatch's loss gets `replicas` times the gradient above (the average of the replicas'
gradients is then the gradient of the whole batch's loss). The count and the loss's sum each
cross the replicas in one small all-reduce (`sum_over_replicas`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zbcompile._torch_internals import pytree
from zbcompile.passes.trace import ROLE_INPUT, TracedModel

ITEM_COUNT = "num_items_in_batch"  # the keyword transformers' models take the batch's label count by
IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossReduction:
    """How a step's microbatch losses make its loss (`kind`, see the module docstring): each
    microbatch loss gets the gradient `tangent` (None where this process does not hold the last
    stage), and `loss()` gives the step's loss. `items`: the batch's count ("sum/count");
    `group`: the data-parallel group the loss's sum is summed over (None: one replica)."""

    kind: str
    tangent: float | None
    items: float | None = None
    group: Any = None

    def loss(self, losses: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
        """The step's loss from its microbatch losses (None where this process has none)."""
        if losses is None:
            return None
        stacked = torch.stack(list(losses)).detach()
        if self.kind == "mean":
            return stacked.mean()
        total = sum_over_replicas(stacked.sum(), self.group)
        return total / self.items if self.kind == "sum/count" else total


def sum_over_replicas(value: torch.Tensor, group: Any) -> torch.Tensor:
    """`value` summed over the data-parallel replicas of `group` (as it is for None)."""
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


def reduction(
    traced: TracedModel, micro_inputs: Sequence[tuple[tuple, dict]], feeds: list[dict[str, torch.Tensor]],
    targets: Sequence[dict[str, torch.Tensor]], module: nn.Module, held: Collection[int], stages: int, layout: Any,
) -> LossReduction:
    """The step's `LossReduction` for `traced` (the compile it runs). `held`: the stages of
    `stages` this process runs; `layout`: this rank's place (`layout.Layout`; None in one
    process), whose data-parallel replicas the count and the loss cross. For "share" the ranks
    holding the first stage count the labels and write the count into `feeds` (in place)."""
    first, last = 0 in held, stages - 1 in held
    replicas, group = (layout.dp_size, layout.dp_group) if layout is not None else (1, None)
    if traced.count is not None:
        if not last:
            return LossReduction("sum/count", None, group=group)
        counts = torch.tensor([traced.count(t) for t in targets], dtype=torch.float64).sum()
        items = float(sum_over_replicas(counts, group))
        return LossReduction("sum/count", replicas / items if items else math.inf, items, group)
    name = _item_count_feed(traced, micro_inputs[0])
    if name is None:
        return LossReduction("mean", 1.0 / len(feeds))
    if first:
        counted = sum(int((_counted_labels(module, kwargs) != IGNORE_INDEX).sum()) for _, kwargs in micro_inputs)
        device = feeds[0][name].device
        items = sum_over_replicas(torch.tensor(counted, dtype=torch.int64, device=device), group)
        for feed in feeds:
            feed[name] = items
    return LossReduction("share", float(replicas), group=group)


def with_item_count(module: nn.Module, loss_fn: Any, micro_inputs: list) -> list:
    """`micro_inputs` with `num_items_in_batch` (a 0-dim placeholder, filled by `reduction`) in
    every microbatch's keyword arguments where the model takes it: no `loss_fn`, `labels` among
    the keyword arguments, and a forward that accepts it (transformers' `accepts_loss_kwargs`, or
    the signature, as transformers' Trainer decides)."""
    if loss_fn is not None or not micro_inputs:
        return micro_inputs
    kwargs = micro_inputs[0][1]
    if ITEM_COUNT in kwargs:
        raise ValueError(
            f"step() got {ITEM_COUNT}=; the pipeline passes it itself (the batch's count of labels other than "
            f"{IGNORE_INDEX}, across microbatches and replicas); leave it out"
        )
    if not isinstance(kwargs.get("labels"), torch.Tensor) or not _accepts_item_count(module):
        return micro_inputs
    placeholder = torch.zeros((), dtype=torch.int64, device=kwargs["labels"].device)
    return [(args, {**kw, ITEM_COUNT: placeholder}) for args, kw in micro_inputs]


def _accepts_item_count(module: nn.Module) -> bool:
    accepts = getattr(module, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.name == ITEM_COUNT or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _item_count_feed(traced: TracedModel, example: tuple[tuple, dict]) -> str | None:
    """The graph input `num_items_in_batch` feeds (`input_<i>`), where the traced loss reads it."""
    args, kwargs = example
    count = kwargs.get(ITEM_COUNT)
    if count is None:
        return None
    tensors = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
    name = f"input_{next(i for i, t in enumerate(tensors) if t is count)}"
    node = next(n for n in traced.placeholders(ROLE_INPUT) if n.meta["zb_name"] == name)
    return name if node.users else None


def _counted_labels(module: nn.Module, kwargs: dict) -> torch.Tensor:
    """The labels a microbatch's loss covers: `shift_labels` where given; `labels[..., 1:]` where
    the model's loss shifts them (transformers' causal-LM loss, which never predicts position 0;
    encoder-decoders excepted); else `labels`."""
    if isinstance(kwargs.get("shift_labels"), torch.Tensor):
        return kwargs["shift_labels"]
    labels = kwargs["labels"]
    return labels[..., 1:] if _loss_shifts_labels(module) else labels


def _loss_shifts_labels(module: nn.Module) -> bool:
    """Whether `module`, or the outermost transformers model it wraps (an autocast or other
    wrapper that passes its keyword arguments on), computes its loss with the causal-LM loss (its
    `loss_function` property, read without its warning for an unknown `loss_type`)."""
    import sys

    if "transformers" not in sys.modules:  # a transformers model imported it
        return False
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    module = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if module is None:
        return False
    chosen = (
        module.__dict__.get("_loss_function") or LOSS_MAPPING.get(getattr(module, "loss_type", None)) or ForCausalLMLoss
    )
    return chosen is ForCausalLMLoss and not getattr(module.config, "is_encoder_decoder", False)
