"""A step's batch, from what `step()` was given to what the runner computes with: the batch the
ranks of a pipeline agreed on and this rank's placeholders where it was given None
(`LocalBatch`), its microbatches and compile key (`split`), the check that a stage never reads a
placeholder (`check_given`), each microbatch as the graph's named inputs (`feeds`), and the check
that data-parallel replicas computed with batches of one size (`ReplicaBatches`).

Which batch the ranks of a distributed pipeline compile for, when some of them pass None: only
the first stage reads the model's inputs and only the last stage reads the targets, so under
torch.distributed a rank may pass None for what its stages do not read. Every rank traces the
whole model, though, so every rank needs the batch's structure and shapes. At each compile the
ranks all-gather a `BatchDescription` of what each was given (pytree structure, tensor shapes and
dtypes, constant arguments); the ranks that were given a part must agree on it, and a rank that
was given None for a part computes with zero-filled `placeholders` of the agreed description,
which its stages never read.

Between compiles nothing is exchanged: a rank that passes None follows the latest agreed
description, so a step with new batch shapes needs the batch on every rank (each rank then
compiles, and the ranks agree again).

Under data parallelism each replica's ranks pass that replica's own batch (DDP's convention):
the agreement runs within one pipeline, and `ReplicaBatches` checks, every step, that the
replicas' batches have one size (the mean of their gradients is the gradient of their
concatenation only then)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Collection

import torch
import torch.distributed as dist

from zbcompile._torch_internals import pytree
from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.parallel.layout import gather_objects

Feed = dict[str, torch.Tensor | int]  # tensors by leaf name, then a shape-generic compile's sizes


@dataclass(frozen=True)
class Part:
    """The structure of the inputs or of the target: the pytree spec (serialised, where its node
    types allow) and, per leaf, a tensor's ("tensor", shape, dtype) or a constant's
    ("constant", value)."""

    spec: str | pytree.TreeSpec
    leaves: tuple[tuple[Any, ...], ...]

    @staticmethod
    def of(tree: Any) -> "Part | None":
        """The description of `tree`, or None when it holds no tensor (the rank passed None)."""
        leaves, spec = pytree.tree_flatten(tree)
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return None
        return Part(_serialised(spec), tuple(
            ("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("constant", x) for x in leaves
        ))

    def placeholders(self, device: torch.device) -> Any:
        """A tree of this structure: zeros for the tensors, the constants themselves."""
        leaves = [
            torch.zeros(leaf[1], dtype=leaf[2], device=device) if leaf[0] == "tensor" else leaf[1]
            for leaf in self.leaves
        ]
        spec = pytree.treespec_loads(self.spec) if isinstance(self.spec, str) else self.spec
        return pytree.tree_unflatten(leaves, spec)

    @property
    def batch_size(self) -> int | None:
        """The leading dimension of the first tensor with one (None when no tensor has one)."""
        return next((leaf[1][0] for leaf in self.leaves if leaf[0] == "tensor" and leaf[1]), None)

    def __str__(self) -> str:
        shown = [f"{leaf[2]}{list(leaf[1])}" if leaf[0] == "tensor" else repr(leaf[1]) for leaf in self.leaves]
        return f"({', '.join(shown)})"


@dataclass(frozen=True)
class BatchDescription:
    """What a step's batch looks like: `inputs` describes `(args, kwargs)`, `target` the target;
    None where a rank was not given that part (or, for `target`, where the model takes none)."""

    inputs: Part | None
    target: Part | None

    @staticmethod
    def of(args: tuple, kwargs: dict, target: Any) -> "BatchDescription":
        return BatchDescription(Part.of((tuple(args), dict(kwargs))), Part.of(target))

    def filled_from(self, other: "BatchDescription") -> "BatchDescription":
        """This description with its absent parts taken from `other`."""
        return BatchDescription(self.inputs or other.inputs, self.target or other.target)


def agree(mine: BatchDescription, group: dist.ProcessGroup | None) -> BatchDescription:
    """All-gather every rank's description over the pipeline's `group` (a collective: each of
    its ranks must call it; None: this rank alone) and return the agreed one. Raises ValueError,
    naming two ranks (global) and what they passed, when ranks that were given a part disagree,
    and when no rank was given the inputs."""
    ranks = [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)
    try:
        gathered = gather_objects(mine, group)
    except RuntimeError as error:
        raise RuntimeError(
            f"rank {dist.get_rank()}: agreeing with the other ranks on the batch to compile for failed "
            f"({str(error).splitlines()[0]}). Every rank compiles when the batch shapes change, and a rank that "
            "passes None follows the latest compiled shapes: pass the batch on every rank for a step with new shapes."
        ) from error
    gathered = dict(zip(ranks, gathered))
    inputs, target = _common(gathered, "inputs"), _common(gathered, "target")
    if inputs is None:
        raise ValueError(
            "no rank passed the model's inputs to step(); the rank holding the first stage needs them "
            "(passing the replica's whole batch on every rank of its pipeline always works)"
        )
    if target is not None and inputs[1].batch_size != target[1].batch_size:
        raise ValueError(
            f"the first stage and the last stage would compute with batches of different sizes: rank {inputs[0]} "
            f"passed inputs of {inputs[1].batch_size} samples {inputs[1]}, rank {target[0]} a target of "
            f"{target[1].batch_size} {target[1]}; every rank of a pipeline passes the same batch (its replica's own "
            "under data parallelism)"
        )
    return BatchDescription(inputs[1], target[1] if target is not None else None)


def _common(gathered: dict[int, BatchDescription], field: str) -> tuple[int, Part] | None:
    """(the first rank given `field`, what it was given), checking that every rank given it got the same."""
    given = [(rank, getattr(d, field)) for rank, d in gathered.items() if getattr(d, field) is not None]
    for rank, part in given[1:]:
        if part != given[0][1]:
            raise ValueError(
                f"ranks passed different {field} to step(): rank {given[0][0]} {given[0][1]}, rank {rank} {part}; "
                "every rank of a pipeline passes the same batch (or None on ranks whose stages do not read the "
                f"{field})"
            )
    return given[0] if given else None


class ReplicaBatches:
    """The check that every data-parallel replica computes a step with a batch of one size: an
    all-gather of `size` over the replicas' `group` (global ranks `replica_ranks`, in group
    order), started asynchronously when made, so that it costs no wait; `check` waits for it
    (every wait has a timeout) and raises ValueError naming the replicas that differ."""

    def __init__(
        self, size: int, group: dist.ProcessGroup, replica_ranks: tuple[int, ...], device: torch.device
    ) -> None:
        self.size, self.replica_ranks = size, replica_ranks
        self.sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in replica_ranks]
        mine = torch.tensor([size], dtype=torch.int64, device=device)
        self.work = dist.all_gather(self.sizes, mine, group=group, async_op=True)

    def check(self, timeout: timedelta) -> None:
        failure = f"rank {dist.get_rank()}: the data-parallel replicas' batch sizes did not arrive within {timeout}"
        advice = "every replica must call step() the same number of times"
        try:
            completed = self.work.wait(timeout)
        except RuntimeError as error:
            raise RuntimeError(f"{failure} ({str(error).splitlines()[0]}); {advice}") from error
        if completed is False:
            raise RuntimeError(f"{failure}; {advice}")
        sizes = [int(s.item()) for s in self.sizes]
        if len(set(sizes)) > 1:
            shown = ", ".join(f"rank {r}: {n}" for r, n in zip(self.replica_ranks, sizes))
            raise ValueError(
                f"data-parallel replicas passed batches of different sizes to step() ({shown} samples); each replica's "
                "ranks pass that replica's own batch, and all replicas need batches of one size (a DistributedSampler "
                "with drop_last=True gives them)"
            )


def _serialised(spec: pytree.TreeSpec) -> str | pytree.TreeSpec:
    """`spec` as pytree's JSON (compared and sent as text), or itself for node types that have
    no serialised name (custom pytree nodes: then pickled)."""
    try:
        return pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError, ValueError):
        return spec


class LocalBatch:
    """The batch this rank computes with under torch.distributed, where a rank may pass None for
    the inputs and for the target: it then computes with placeholders shaped like the batch the
    ranks agreed on (`agree`), made once per agreed shape."""

    def __init__(self) -> None:
        self.agreed: list[BatchDescription] = []  # batches the ranks agreed on, latest last
        self._placeholders: dict[str, tuple[Part, Any]] = {}

    def of(
        self, args: tuple, kwargs: dict, target: Any, group: Any, device: torch.device, every_step: bool = False
    ) -> tuple[tuple, dict, Any, tuple[str, ...]]:
        """(args, kwargs, target, the parts not given: "inputs", "target"); `group` is the
        pipeline's process group (the ranks agree over it when a batch's shapes are new, or with
        `every_step` on every step: a shape-generic compile's sizes change without a compile)."""
        mine = BatchDescription.of(args, kwargs, target)
        agreed = mine.filled_from(self.agreed[-1]) if self.agreed else None
        if every_step or agreed not in self.agreed:
            agreed = agree(mine, group)
            if agreed in self.agreed:
                self.agreed.remove(agreed)
            self.agreed.append(agreed)
        absent = []
        if mine.inputs is None:
            args, kwargs = self._placeholder("inputs", agreed.inputs, device)
            absent.append("inputs")
        if mine.target is None and agreed.target is not None:
            target = self._placeholder("target", agreed.target, device)
            absent.append("target")
        return args, kwargs, target, tuple(absent)

    def _placeholder(self, part_name: str, part: Part, device: torch.device) -> Any:
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
    described = tuple(
        ("tensor", tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else ("constant", _constant_key(t))
        for t in [*leaves, *target_leaves]
    )
    return micro_inputs, micro_targets, (spec, target_spec, described)


def feeds(compiled: CompiledPipeline, micro_inputs: list, micro_targets: list) -> tuple[list[Feed], list[Feed]]:
    """Every microbatch (`split`) as the graph's inputs and targets (`feed`)."""
    fed = [feed(compiled, args, kwargs, target) for (args, kwargs), target in zip(micro_inputs, micro_targets)]
    return [f[0] for f in fed], [f[1] for f in fed]


def fed(
    runner: Any, micro_inputs: list, micro_targets: list, absent: tuple[str, ...], ownership: Any, stages: int
) -> tuple[list[Feed], list[Feed]]:
    """What a step of `runner` (a training or forward-only runner of `stages` stages) computes
    with: refused where a stage it holds reads a part this rank was not given (`check_given`) or
    a tensor materialised from `meta` and never filled; the module's current tensors set
    (`ownership`: its `state_ownership.StateOwnership`); the microbatches as the graphs' inputs
    and targets (`feeds`)."""
    check_given(absent, stages, runner.executors)
    ownership.check_filled()
    runner.set_state(ownership.state())  # the module's current tensors, even if reassigned
    return feeds(runner.compiled, micro_inputs, micro_targets)


def leaf_tensors(args: tuple, kwargs: dict, target: Any) -> dict[str, torch.Tensor]:
    """A microbatch's tensors by the trace's leaf names (`input_<i>`, `target_<i>`)."""
    inputs, targets = _named_leaves(args, kwargs, target)
    return {**inputs, **targets}


def _named_leaves(args: tuple, kwargs: dict, target: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    inputs = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
    targets = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
    return {f"input_{i}": t for i, t in enumerate(inputs)}, {f"target_{i}": t for i, t in enumerate(targets)}


def feed(compiled: CompiledPipeline, args: tuple, kwargs: dict, target: Any) -> tuple[Feed, Feed]:
    """One microbatch as the graph's inputs (`input_<i>`, then a shape-generic compile's sizes)
    and targets (`target_<i>`)."""
    traced = compiled.traced
    # no target leaves without a loss_fn or with a None target (the graph has no target inputs)
    inputs, targets = _named_leaves(args, kwargs, target if traced.target_spec is not None else None)
    # the graphs were traced on contiguous tensors
    inputs = {name: t.contiguous() for name, t in inputs.items()}
    targets = {name: t.contiguous() for name, t in targets.items()}
    symbols = traced.symbols
    if symbols is not None:  # a shape-generic compile: this microbatch's sizes feed every stage
        values = symbols.bind({**inputs, **targets})
        if values is None:
            raise ValueError(
                f"this compile serves {symbols.describe()} within its guards, and this microbatch's shapes "
                f"{[tuple(t.shape) for t in [*inputs.values(), *targets.values()]]} fall outside them"
            )
        inputs.update(symbols.sizes(values))
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
