"""Keep the model's `torch.no_grad()` regions through tracing.

The traced graph is aten-level: it records what every op computes, not whether autograd
recorded it, so a value the forward computes under `torch.no_grad()` from activations (a batch
statistic, a teacher's output) would get a gradient when each stage's joint graph is traced
again. `recording_no_grad()` marks, while tracing, the nodes of every torch call made with grad
disabled on a tensor that requires grad (`node.meta["custom"]["no_grad"]`); then
`detach_no_grad_results(graph)` makes every other node read such a value through `aten.detach`,
which is what autograd did in the eager forward.

In-place updates under `torch.no_grad()` of a tensor that requires grad (`h.mul_(2)`) are
refused: eager autograd lets the gradient through them unchanged, which the functional graph
cannot express.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from zbcompile import _torch_internals as ti

NO_GRAD = "no_grad"


def _requires_grad(tree: object) -> bool:
    return any(isinstance(x, torch.Tensor) and ti.requires_grad_unwrapped(x) for x in pytree.tree_leaves(tree))


def _is_in_place(func: object) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__"))
    return name.endswith("_")


class recording_no_grad(TorchFunctionMode):
    """While active (around the trace), annotates the nodes of torch calls made under no_grad
    that read a tensor requiring grad. `where()` names the module being traced, for errors."""

    def __init__(self, where) -> None:
        super().__init__()
        self._where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled() or not _requires_grad((args, kwargs)):
            return func(*args, **kwargs)
        if _is_in_place(func) and args and _requires_grad(args[0]):
            raise ValueError(
                f"module '{self._where()}' updates a tensor that requires grad in place under torch.no_grad() "
                f"({getattr(func, '__qualname__', func)}); the gradient would pass through the update unchanged in "
                "eager mode, which a traced graph cannot express. Update a copy instead (`h = h.detach().clone()` "
                "first, or compute `h = h + (update - h).detach()` outside no_grad)."
            )
        with ti.annotate_nodes({NO_GRAD: True}):
            return func(*args, **kwargs)


def _marked(node: fx.Node) -> bool:
    return bool(node.meta.get("custom", {}).get(NO_GRAD))


def detach_no_grad_results(graph: fx.Graph) -> None:
    """Make every unmarked node read a marked node's floating-point result through one
    `aten.detach` (tuple results: through their getitems, marked too)."""
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if not _marked(node) or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        readers = [u for u in node.users if not _marked(u)]
        if not readers:
            continue
        with graph.inserting_after(node):
            detached = graph.call_function(torch.ops.aten.detach.default, (node,))
        detached.meta = {k: v for k, v in node.meta.items() if k != "custom"}
        detached.meta["custom"] = {k: v for k, v in node.meta.get("custom", {}).items() if k != NO_GRAD}
        for reader in readers:
            reader.replace_input_with(node, detached)
