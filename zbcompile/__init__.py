"""zbcompile: zero-bubble pipeline parallelism as a compiler pass over traced FX graphs.

    model = zbcompile.pipeline(model, stages=4, microbatches=8, loss_fn=F.cross_entropy)
    loss = model.step(inputs, target=targets)

`zbcompile.schedules` is pure Python; importing it (or this package) does not import torch
until `pipeline` or `PipelinedModule` is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it, imported on first use
_MODULE_OF = {
    "pipeline": "zbcompile.api",
    "plan": "zbcompile.planner.plan",
    "Plan": "zbcompile.planner.plan",
    "Hardware": "zbcompile.planner.hardware",
    "PipelinedModule": "zbcompile.api",
    "PostValidatedOptimizer": "zbcompile.runtime.state.optimizer",
    "SynchronousClipOptimizer": "zbcompile.runtime.state.optimizer",
    # the torch.compile backend (zbcompile/backend.py)
    "WeightGradStore": "zbcompile.backend",
    "active_store": "zbcompile.backend",
    "defer_weight_grads": "zbcompile.backend",
    "take_weight_grads": "zbcompile.backend",
}
_SUBMODULES = ("checkpoint",)  # zbcompile.checkpoint.save / load / latest
__all__ = sorted((*_MODULE_OF, *_SUBMODULES))


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"zbcompile.{name}")
    raise AttributeError(f"module 'zbcompile' has no attribute {name!r}")
