"""Tensor parallelism at run time: the user's plan applied on the mesh's "tp" dimension and the
model checked against the layout (`apply_plan`, `check_model`), and partial sums of gradients
reduced over the tp group (`reduce_partial_grads`); parameters as the stage programs compute with
them are `state_ownership.local_state`'s.

How the trace and the stage programs treat tensor-parallel modules is `passes/tensor_parallel.py`'s
job; here the runtime keeps DTensor parameters (each rank its shard), so `pipe.parameters()`,
torch.optim, `state_dict()` and torch.distributed.checkpoint see torch's own representation."""

from __future__ import annotations

from datetime import timedelta
from fnmatch import fnmatch
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from zbcompile.passes.tensor_parallel import TP, is_tensor_parallel, parallel_modules
from zbcompile.runtime.parallel.layout import Layout
from zbcompile.runtime.parallel.sharding import wait

# attributes that count attention heads, on a module or its `config` (transformers, torchtitan, the zoo)
HEAD_COUNTS = (
    "heads", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads",
)


def _matches(pattern: str, fqn: str) -> bool:
    """Whether a plan key (`parallelize_module`'s: dot-separated fnmatch patterns) names `fqn`."""
    tokens, parts = pattern.split("."), fqn.split(".")
    return len(tokens) == len(parts) and all(fnmatch(p, t) for t, p in zip(tokens, parts))


def apply_plan(module: nn.Module, plan: Mapping[str, ParallelStyle], layout: Layout) -> None:
    """Apply `plan` ({module-FQN pattern: ParallelStyle}) with torch's `parallelize_module` on the
    layout's "tp" mesh dimension, to the whole model (the trace needs every module's layout; on a
    meta model nothing is allocated); a pattern naming no module, a layout without such a
    dimension or a model parallelized already is refused."""
    if layout.mesh is None or TP not in (layout.mesh.mesh_dim_names or ()):
        raise ValueError(
            f"pipeline(tensor_parallel=...) applies its plan on the '{TP}' dimension of a DeviceMesh; pass "
            "process_group=<DeviceMesh with dimensions ('dp', 'pp', 'tp') or a subset in that order>"
        )
    already = list(parallel_modules(module))
    if already:
        raise ValueError(
            f"pipeline(tensor_parallel=...): {type(module).__name__} is tensor-parallel already (e.g. module "
            f"{already[0]!r}, parallelized over the '{TP}' mesh dimension of {layout.tp_size} ranks); apply the plan "
            "once: either parallelize_module before compiling or tensor_parallel=, not both"
        )
    names = [n for n, _ in module.named_modules() if n]
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tensor_parallel: the plan's entry {pattern!r} must be a torch ParallelStyle (ColwiseParallel(), "
                f"RowwiseParallel(), ...), got {type(style).__name__}"
            )
        if pattern and not any(_matches(pattern, n) for n in names):
            close = [n for n in names if n.split(".")[-1] == pattern.split(".")[-1]][:3] or names[:3]
            raise ValueError(
                f"tensor_parallel: the plan names module {pattern!r}, which {type(module).__name__} does not have "
                f"(mesh dimension '{TP}' of {layout.tp_size} ranks); its modules are named like {close}"
            )
    parallelize_module(module, layout.mesh[TP], dict(plan))


def check_model(module: nn.Module, layout: Layout) -> None:
    """Refuse a model whose tensor parallelism does not fit `layout`: DTensor parameters over
    another mesh than the layout's "tp" dimension, a "tp" dimension and no tensor-parallel module
    (or one without a "tp" dimension), a sharded dimension or a head count the tp degree does not
    divide. Each error names the mesh dimension, the module and the sizes."""
    parallel = parallel_modules(module)
    if layout.tp_size == 1 and not parallel:
        return
    if not parallel:
        raise ValueError(
            f"the DeviceMesh's '{TP}' dimension has {layout.tp_size} ranks but {type(module).__name__} has no "
            "tensor-parallel module; pass pipeline(tensor_parallel={'<module pattern>': ColwiseParallel(), ...}) "
            f"or apply parallelize_module(..., mesh['{TP}'], plan) before compiling"
        )
    tp_ranks = dist.get_process_group_ranks(layout.tp_group) if layout.tp_group is not None else [dist.get_rank()]
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not is_tensor_parallel(tensor):
            if isinstance(tensor, DTensor):
                raise ValueError(
                    f"parameter {name!r} is a DTensor over a mesh without a '{TP}' dimension "
                    f"({tensor.device_mesh.mesh_dim_names}); parallelize with the '{TP}' dimension of the DeviceMesh "
                    "given to pipeline()"
                )
            continue
        mesh = tensor.device_mesh[TP] if tensor.device_mesh.ndim > 1 else tensor.device_mesh
        if sorted(mesh.mesh.flatten().tolist()) != sorted(tp_ranks):
            raise ValueError(
                f"parameter {name!r} is sharded over ranks {mesh.mesh.flatten().tolist()}, but this rank's '{TP}' "
                f"ranks in the DeviceMesh given to pipeline() are {tp_ranks}; parallelize with that mesh's '{TP}' "
                "dimension"
            )
        _check_divisible(name, tensor, layout.tp_size)
    _check_head_counts(module, parallel, layout.tp_size)


def _check_divisible(name: str, tensor: DTensor, tp: int) -> None:
    index = (tensor.device_mesh.mesh_dim_names or ()).index(TP)
    placement = tensor.placements[index]
    if placement.is_shard() and tensor.shape[placement.dim] % tp:
        module = name.rpartition(".")[0] or "<root>"
        raise ValueError(
            f"module '{module}': parameter {name.rpartition('.')[2]!r} of shape {tuple(tensor.shape)} is sharded on "
            f"dimension {placement.dim} (size {tensor.shape[placement.dim]}) over the '{TP}' mesh dimension of {tp} "
            f"ranks, which does not divide it; choose a tp degree that divides {tensor.shape[placement.dim]}"
        )


def _check_head_counts(module: nn.Module, parallel: Iterable[str], tp: int) -> None:
    """Every head count (`HEAD_COUNTS`) of a module holding a tensor-parallel one, or of its config,
    must be a multiple of the tp degree: each rank computes whole heads."""
    holders = [n for n, _ in module.named_modules() if any(p == n or p.startswith(f"{n}.") or not n for p in parallel)]
    for name in holders:
        owner = module.get_submodule(name)
        for source in (owner, getattr(owner, "config", None)):
            for attribute in HEAD_COUNTS:
                count = getattr(source, attribute, None)
                if isinstance(count, int) and not isinstance(count, bool) and count % tp:
                    where = "its config's " if source is not owner else ""
                    raise ValueError(
                        f"module '{name or '<root>'}' ({type(owner).__name__}): {where}{attribute}={count} is not a "
                        f"multiple of the '{TP}' mesh dimension's {tp} ranks; each rank computes whole heads, so "
                        f"choose a tp degree that divides {count}"
                    )


def reduce_partial_grads(
    grads: dict[str, torch.Tensor], fqns: Iterable[str], group: dist.ProcessGroup | None, timeout: timedelta
) -> None:
    """Sum over the tp `group`, in place and in name order (the same on every rank of the group),
    the gradients named in `fqns` that `grads` holds: partial sums of replicated parameters."""
    if group is None:
        return
    for fqn in sorted(set(fqns) & set(grads)):
        grad = grads[fqn].to_local() if isinstance(grads[fqn], DTensor) else grads[fqn]
        work = dist.all_reduce(grad, group=group, async_op=True)
        wait(work, timeout, f"summing the gradient of {fqn} over the tensor-parallel ranks", over="tensor-parallel")
