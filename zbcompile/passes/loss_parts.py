"""What a traced forward returns besides one scalar loss.

- A whole-batch loss: `loss_fn` may return `(loss_sum, count)` for a microbatch, the sum of its
  per-item losses and how many items they cover (e.g. labels other than -100). The traced graph
  then computes `loss_sum` as its loss, and `count` is cut out into a graph of its own over the
  targets (`ItemCount`), which the runtime runs for every microbatch before the step: the
  gradient of sum(loss_sum) / sum(count) needs the whole batch's count before the first backward.
- The model's outputs (`evaluate(return_outputs=True)`): the tensor leaves of what the model
  returns, in pytree order; `OutputStructure` puts the concatenated leaves back together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from zbcompile._torch_internals import pytree
from zbcompile.passes import _fx


@dataclass(frozen=True)
class ItemCount:
    """A microbatch's item count: `constant` (a Python number `loss_fn` returned), or `graph`
    run on the microbatch's target tensors (placeholders named `target_<i>`, returning the count
    as a 0-dim tensor)."""

    graph: fx.GraphModule | None = None
    targets: tuple[str, ...] = ()
    constant: float | None = None

    def __call__(self, targets: dict[str, torch.Tensor]) -> float:
        if self.graph is None:
            return float(self.constant)
        with torch.no_grad():
            return float(self.graph(*[targets[name] for name in self.targets]))


def sum_and_count(value: Any) -> tuple[Any, Any]:
    """(loss_sum, count) from what `loss_fn` returned: a scalar loss (no count) or a pair whose
    count is a number or a 0-dim tensor."""
    if not isinstance(value, (tuple, list)):
        return value, None
    if len(value) != 2:
        raise TypeError(
            f"loss_fn returned a {type(value).__name__} of {len(value)} values; return a scalar loss (the microbatch's "
            "mean), or (loss_sum, count): the sum of the per-item losses and how many items they cover"
        )
    loss_sum, count = value
    if isinstance(count, bool) or not isinstance(count, (int, float, torch.Tensor)):
        raise TypeError(
            f"loss_fn returned (loss_sum, count) with a count of type {type(count).__name__}; return a number or a "
            "0-dim tensor"
        )
    if isinstance(count, torch.Tensor) and count.dim() != 0:
        raise TypeError(
            f"loss_fn returned (loss_sum, count) with a count of shape {tuple(count.shape)}; return a 0-dim tensor"
        )
    return loss_sum, count


def cut_out_count(graph_module: fx.GraphModule, count: Any, role_of: dict[fx.Node, str]) -> ItemCount:
    """The count of a `(loss_sum, count)` loss: its own graph over the targets, taken out of the
    outputs of `graph_module` (the traced forward returning (loss_sum, count), or only loss_sum
    when `count` was a Python number). `role_of`: each placeholder's role ("target", ...).
    Raises ValueError when the count reads anything but the targets."""
    if not isinstance(count, torch.Tensor):
        return ItemCount(constant=float(count))
    graph = graph_module.graph
    output = graph.output_node()
    loss, count_node = output.args[0]
    output.args = ((loss,),)
    needed = _fx.ancestors([count_node])
    readers = [n for n in needed if n.op == "placeholder" and role_of[n] != "target"]
    if readers:
        names = sorted(n.meta.get("zb_name", n.name) for n in readers)
        raise ValueError(
            f"loss_fn returned (loss_sum, count) with a count computed from {names}; the count must come from the "
            "target alone (e.g. (target != -100).sum()), so that the whole batch's count is known before the backward"
        )
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in graph.nodes if n in needed and n.op == "placeholder"]
    for node in placeholders:
        env[node] = new_graph.placeholder(node.meta["zb_name"])
        env[node].meta = dict(node.meta)
    _fx.copy_nodes(new_graph, [n for n in graph.nodes if n in needed and n.op != "placeholder"], env)
    new_graph.output(env[count_node])
    counted = _fx.finish(new_graph, graph_module, name="ItemCount")
    return ItemCount(graph=counted, targets=tuple(n.meta["zb_name"] for n in placeholders))


@dataclass(frozen=True)
class OutputStructure:
    """Where the traced tensor leaves of a model's output go: `spec` of the whole output and,
    per leaf, whether it is a traced tensor (`traced`) or else the constant the output held there
    (`constants`)."""

    spec: pytree.TreeSpec
    traced: tuple[bool, ...]
    constants: tuple[Any, ...]

    @staticmethod
    def of(output: Any) -> tuple["OutputStructure", list[torch.Tensor]]:
        """The structure of `output` and its tensor leaves. Raises TypeError for a leaf that is
        neither a tensor nor a plain constant (None, a number, a string)."""
        leaves, spec = pytree.tree_flatten(output)
        for leaf in leaves:
            if not (isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (bool, int, float, str))):
                raise TypeError(
                    f"the model's output holds a {type(leaf).__name__}, which evaluate(return_outputs=True) cannot "
                    "return; ask the model for tensors only (for a transformers model, pass use_cache=False)"
                )
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        traced = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
        return OutputStructure(spec, traced, tuple(None if t else leaf for t, leaf in zip(traced, leaves))), tensors

    def rebuild(self, per_microbatch: Sequence[Sequence[torch.Tensor]]) -> Any:
        """The model's output for the whole batch from each microbatch's tensor leaves: a leaf
        with a batch dimension concatenated along dim 0, a 0-dim one (a loss the model
        computes) stacked into one value per microbatch."""
        merged = iter([
            torch.cat(parts) if parts[0].dim() else torch.stack(parts) for parts in zip(*per_microbatch)
        ])
        return pytree.tree_unflatten([next(merged) if t else c for t, c in zip(self.traced, self.constants)], self.spec)
