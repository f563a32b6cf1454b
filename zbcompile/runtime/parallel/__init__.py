"""The dimensions around a pipeline: this rank's layout and process groups (and collectives over
them), the batch agreed and split into microbatches, the step's loss, gradients reduced over
replicas, data-parallel sharding and tensor parallelism.

Imports no other room of the runtime, only the layers below it."""
