"""Keep what autograd does inside the model's forward, which an aten-level trace does not record.

The traced graph records what every op computes, not whether autograd recorded it; each stage's
joint graph is traced again from it, differentiating every op. So, while the forward is traced,
`watching_autograd(where)` (a torch function mode):

- marks the nodes of every torch call made under `torch.no_grad()` on a tensor that requires
  grad (`node.meta["custom"]["no_grad"]`); `detach_no_grad_results(graph)` then makes every other
  node read such a value through `aten.detach` (a batch statistic, a teacher's output);
- turns `tensor.data` into `tensor.detach()` (the same value, outside autograd), and makes
  `tensor.requires_grad` answer what it answers eagerly (tracing wraps every tensor in one that
  never requires grad);
- refuses with a ValueError naming the module what a functional graph cannot express: a
  gradient hook on a tensor (`register_hook`), an in-place update under `torch.no_grad()` of a
  tensor that requires grad (eager autograd passes the gradient through it unchanged), and
  `max_norm` embeddings (they renormalise the weight in place in the forward).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import TorchFunctionMode

from zbcompile import _torch_internals as ti
from zbcompile._torch_internals import pytree
from zbcompile.passes import _fx

NO_GRAD = "no_grad"
_DATA = ti.TENSOR_DATA
_REQUIRES_GRAD = ti.TENSOR_REQUIRES_GRAD
_HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)


def _requires_grad(tree: object) -> bool:
    return any(isinstance(x, torch.Tensor) and ti.requires_grad_unwrapped(x) for x in pytree.tree_leaves(tree))


def _is_in_place(func: object) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name == "__setitem__" or (
            name.startswith("__i") and name not in ("__init__", "__index__", "__int__", "__invert__", "__iter__")
        )
    return name.endswith("_")


class watching_autograd(TorchFunctionMode):
    """Active around the traced forward; `where()` names the module being traced (for errors)."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self._where = where

    def _refuse(self, what: str, remedy: str) -> ValueError:
        return ValueError(f"module '{self._where()}' {what}, which a traced pipeline stage cannot reproduce. {remedy}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        descriptor = getattr(func, "__self__", None)
        if descriptor is _DATA:
            return args[0].detach()
        if descriptor is _REQUIRES_GRAD and getattr(func, "__name__", "") == "__get__":
            return ti.requires_grad_unwrapped(args[0])
        if func in _HOOKS:
            raise self._refuse(
                "registers a gradient hook on a tensor in its forward",
                "Remove the hook; change the gradient through the loss, or the parameters' .grad after step().",
            )
        if (
            func in (F.embedding, F.embedding_bag)
            and kwargs.get("max_norm", args[3] if len(args) > 3 else None) is not None
        ):
            raise self._refuse(
                "uses an embedding with max_norm (it renormalises the weight in place during the forward)",
                "Create the embedding without max_norm and renormalise the weight outside the forward.",
            )
        if torch.is_grad_enabled() or not _requires_grad((args, kwargs)):
            return func(*args, **kwargs)
        if _is_in_place(func) and args and _requires_grad(args[0]):
            raise self._refuse(
                "updates a tensor that requires grad in place under torch.no_grad() "
                f"({getattr(func, '__qualname__', func)}): "
                "eager autograd passes the gradient through the update unchanged",
                "Update a copy (`h = h.detach().clone()` first), or write `h = h + (update - h).detach()` "
                "outside no_grad.",
            )
        with ti.annotate_nodes({NO_GRAD: True}):
            return func(*args, **kwargs)


def _marked(node: fx.Node) -> bool:
    return bool(node.meta.get("custom", {}).get(NO_GRAD))


def detach_no_grad_results(graph: fx.Graph) -> None:
    """Make every unmarked node read a marked node's floating-point or complex result through one
    `aten.detach` (tuple results: through their getitems, marked too)."""
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if not _marked(node) or not _fx.is_differentiable(value):
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
