"""zbcompile: zero-bubble pipeline parallelism as a compiler pass over traced FX graphs.

    model = zbcompile.pipeline(model, stages=4, microbatches=8, loss_fn=F.cross_entropy)
    loss = model.step(inputs, target=targets)

`zbcompile.schedules` is pure Python; importing it (or this package) does not import torch
until `pipeline` or `PipelinedModule` is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PipelinedModule", "pipeline"]
# the torch.compile backend's public names (see zbcompile/backend.py)
_BACKEND_NAMES = ("WeightGradStore", "active_store", "defer_weight_grads", "take_weight_grads")


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("zbcompile.api"), name)
    if name in _BACKEND_NAMES:
        return getattr(importlib.import_module("zbcompile.backend"), name)
    raise AttributeError(f"module 'zbcompile' has no attribute {name!r}")
