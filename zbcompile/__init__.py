"""zbcompile: zero-bubble pipeline parallelism as a compiler pass over traced FX graphs.

    model = zbcompile.pipeline(model, stages=4, microbatches=8, loss_fn=F.cross_entropy)
    loss = model.step(inputs, target=targets)

`zbcompile.schedules` is pure Python; importing it (or this package) does not import torch
until `pipeline` or `PipelinedModule` is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PipelinedModule", "PostValidatedOptimizer", "SynchronousClipOptimizer", "pipeline"]
_MODULE_OF = {"PostValidatedOptimizer": "zbcompile.runtime.optimizer", "SynchronousClipOptimizer": "zbcompile.runtime.optimizer"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_MODULE_OF.get(name, "zbcompile.api")), name)
    raise AttributeError(f"module 'zbcompile' has no attribute {name!r}")
