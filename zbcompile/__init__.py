"""zbcompile: zero-bubble pipeline parallelism as a compiler pass over traced FX graphs.

    model = zbcompile.pipeline(model, stages=4, microbatches=8, loss_fn=F.cross_entropy)
    loss = model.step(inputs, target=targets)
"""

from zbcompile.api import PipelinedModule, pipeline

__all__ = ["PipelinedModule", "pipeline"]
