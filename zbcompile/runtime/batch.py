"""A step's batch, from what `step()` was given to what the runner computes with: the batch this
rank computes with (placeholders where a rank was given None, `LocalBatch`), its microbatches
and compile key (`split`), the check that a stage never reads a placeholder (`check_given`), and
each microbatch as the graph's named inputs (`feeds`)."""

from __future__ import annotations

from typing import Any, Collection

import torch
import torch.distributed as dist

from zbcompile._torch_internals import pytree
from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime import batch_agreement
from zbcompile.runtime.batch_agreement import BatchDescription

Feed = dict[str, torch.Tensor]


class LocalBatch:
    """The batch this rank computes with under torch.distributed, where a rank may pass None for
    the inputs and for the target: it then computes with placeholders shaped like the batch the
    ranks agreed on (see `batch_agreement`), made once per agreed shape."""

    def __init__(self) -> None:
        self.agreed: list[BatchDescription] = []  # batches the ranks agreed on, latest last
        self._placeholders: dict[str, tuple[batch_agreement.Part, Any]] = {}

    def of(
        self, args: tuple, kwargs: dict, target: Any, group: Any, device: torch.device
    ) -> tuple[tuple, dict, Any, tuple[str, ...]]:
        """(args, kwargs, target, the parts not given: "inputs", "target"); `group` is the
        pipeline's process group (the ranks agree over it when a batch's shapes are new)."""
        mine = BatchDescription.of(args, kwargs, target)
        agreed = mine.filled_from(self.agreed[-1]) if self.agreed else None
        if agreed not in self.agreed:
            agreed = batch_agreement.agree(mine, group)
            self.agreed.append(agreed)
        absent = []
        if mine.inputs is None:
            args, kwargs = self._placeholder("inputs", agreed.inputs, device)
            absent.append("inputs")
        if mine.target is None and agreed.target is not None:
            target = self._placeholder("target", agreed.target, device)
            absent.append("target")
        return args, kwargs, target, tuple(absent)

    def _placeholder(self, part_name: str, part: batch_agreement.Part, device: torch.device) -> Any:
        cached = self._placeholders.get(part_name)
        if cached is None or cached[0] != part:
            cached = (part, part.placeholders(device))
            self._placeholders[part_name] = cached
        return cached[1]


def check_given(absent: tuple[str, ...], stages: int, held: Collection[int]) -> None:
    """Refuse to run a stage on placeholders: the rank holding the first stage needs the inputs,
    the one holding the last stage the target (`held`: the stages this rank holds)."""
    readers = {"inputs": (0, "first"), "target": (stages - 1, "last")}
    for part in absent:
        stage, which = readers[part]
        if stage in held:
            raise ValueError(
                f"rank {dist.get_rank()} holds stage {stage}, the {which} stage, which reads the {part}, but "
                f"step() got None for the {part} here; pass the {part} on this rank"
            )


def split(inputs: tuple, kwargs: dict, target: Any, microbatches: int):
    """Every tensor of the batch split along dim 0 in `microbatches` equal parts (under data
    parallelism, the batch is this replica's own, as with DDP). Returns (per microbatch (args,
    kwargs), per microbatch target, the compile key: the batch's structure, tensor shapes, dtypes
    and devices, and constants)."""
    m = microbatches
    leaves, spec = pytree.tree_flatten((tuple(inputs), dict(kwargs)))
    target_leaves, target_spec = pytree.tree_flatten(target)
    tensors = [x for x in [*leaves, *target_leaves] if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("step() needs at least one tensor input to split into microbatches")
    batch = tensors[0].shape[0] if tensors[0].dim() else None
    for x in tensors:
        if x.dim() == 0 or x.shape[0] != batch:
            raise ValueError(
                f"every tensor passed to step() is split along dim 0 into microbatches, so all need the "
                f"same batch size; got shapes {[tuple(t.shape) for t in tensors]}. Pass per-model constants "
                "as buffers of the model instead."
            )
    if batch % m:
        raise ValueError(
            f"the batch of {batch} samples does not split into microbatches={m} equal microbatches; "
            f"use a batch size divisible by {m}"
        )

    def chunks(values: list) -> list[list]:
        return [[v.chunk(m)[i] if isinstance(v, torch.Tensor) else v for v in values] for i in range(m)]

    micro_inputs = [pytree.tree_unflatten(c, spec) for c in chunks(leaves)]
    micro_targets = (
        [pytree.tree_unflatten(c, target_spec) for c in chunks(target_leaves)] if target is not None else [None] * m
    )
    key = (
        spec,
        target_spec,
        tuple(
            (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else _constant_key(t)
            for t in [*leaves, *target_leaves]
        ),
    )
    return micro_inputs, micro_targets, key


def feeds(compiled: CompiledPipeline, micro_inputs: list, micro_targets: list) -> tuple[list[Feed], list[Feed]]:
    """Every microbatch (`split`) as the graph's inputs and targets (`feed`)."""
    fed = [feed(compiled, args, kwargs, target) for (args, kwargs), target in zip(micro_inputs, micro_targets)]
    return [f[0] for f in fed], [f[1] for f in fed]


def feed(compiled: CompiledPipeline, args: tuple, kwargs: dict, target: Any) -> tuple[Feed, Feed]:
    """One microbatch as the graph's inputs (`input_<i>`) and targets (`target_<i>`)."""
    traced = compiled.traced
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    # the graphs were traced on contiguous tensors
    tensors = [x.contiguous() for x in leaves if isinstance(x, torch.Tensor)]
    inputs = {f"input_{i}": t for i, t in enumerate(tensors)}
    # no target leaves without a loss_fn or with a None target (the graph has no target inputs)
    target_tensors = [t.contiguous() for t in pytree.tree_leaves(target)] if traced.target_spec is not None else []
    targets = {f"target_{i}": t for i, t in enumerate(target_tensors)}
    return inputs, targets


def device_of(batch: Any) -> torch.device:
    """Where a one-process pipeline computes: the device of the batch's first tensor."""
    tensors = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _constant_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)
