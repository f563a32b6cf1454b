"""Parameters, their gradients and buffers handed between the ranks of a pipeline whose cut
changes (`runtime/tuning/recut.py`): point to point, from a rank that held each one under the old cut to
every rank that holds it under the new one and did not; ranks that no longer hold one let it go
(the module then keeps a `meta` tensor in its place, as for any tensor a rank does not hold).

The ranks agree on every move without a handshake: each knows both cuts (every rank compiles
both), so the moves and their order are the same everywhere; one gather tells what only a
sender knows (whether a parameter has a `.grad`, its dtype, whether a tensor materialised from
`meta` is still unfilled, and its DTensor layout). A DTensor (a tensor-parallel shard over "tp",
under data_parallel="shard" a shard over "dp" too) moves as its local shard: a pipeline's ranks
share their replica and tensor-parallel coordinates, so the sender's shard is the one the
receiver must hold, and the receiver wraps it as the same DTensor (the sender's mesh dimensions,
placements, global shape and stride). The bits that arrive are the bits sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.parallel.layout import Layout, device_for, gather_objects
from zbcompile.runtime.state import placement
from zbcompile.runtime.step.transport import MessageTransport
from zbcompile.schedules import Schedule

STATE_TAG = 1 << 26  # above every step's, post-validation's and tied weights' tags


def holders(compiled: CompiledPipeline, schedule: Schedule) -> dict[str, set[int]]:
    """Canonical FQN -> the pipeline positions whose stages read it (parameters and buffers)."""
    result: dict[str, set[int]] = {}
    for s, stage in enumerate(compiled.partition.stages):
        for fqn in (*stage.param_fqns, *stage.buffer_fqns):
            result.setdefault(fqn, set()).update(schedule.ranks_of(s))
    return result


@dataclass(frozen=True)
class Move:
    """`fqn` handed from pipeline position `source` to `target`."""

    fqn: str
    source: int
    target: int


def moves(old: Mapping[str, set[int]], new: Mapping[str, set[int]]) -> list[Move]:
    """Every tensor to every position that holds it under `new` and not under `old`, from the
    first position that held it; in one order (by name, then target) on every rank."""
    found = []
    for fqn in sorted(new):
        sources = sorted(old.get(fqn, ()))
        for target in sorted(new[fqn] - old.get(fqn, set())):
            if sources:
                found.append(Move(fqn, sources[0], target))
    return found


@dataclass(frozen=True)
class _Layout:
    """A DTensor's layout: the names of its mesh's dimensions, its placements, global shape and stride."""

    dims: tuple[str, ...]
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Sent:
    """What the receiver cannot know of a tensor: its gradient's dtype (None: no `.grad`),
    whether it was materialised from `meta` and never filled, the shape of what is sent (the
    local shard of a DTensor) and, for a DTensor, its layout."""

    grad_dtype: torch.dtype | None
    unfilled: bool
    local_shape: torch.Size
    dtensor: _Layout | None

    @staticmethod
    def of(tensor: torch.Tensor, unfilled: bool) -> "_Sent":
        layout = None
        if isinstance(tensor, DTensor):
            dims = tuple(tensor.device_mesh.mesh_dim_names or ())
            layout = _Layout(dims, tuple(tensor.placements), tensor.shape, tensor.stride())
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        return _Sent(None if grad is None else grad.dtype, unfilled, local.shape, layout)


def transfer(
    module: nn.Module, ownership, plan: list[Move], dropped: set[str], layout: Layout, transport: MessageTransport
) -> None:
    """Run `plan` (this rank sends what it is the source of, receives what it is the target of,
    in the plan's order), then let go of `dropped` (canonical FQNs this rank no longer holds).
    `ownership`: the module's `state_ownership.StateOwnership` (its unfilled names follow)."""
    state = placement.state_tensors(module)
    me = layout.pp_rank
    mine = {m.fqn: _Sent.of(state[m.fqn], m.fqn in ownership.unfilled) for m in plan if m.source == me}
    sent: dict[str, _Sent] = {}
    for part in gather_objects(mine, layout.pp_group):
        sent.update(part)
    arrived: dict[str, torch.Tensor] = {}
    for index, move in enumerate(plan):
        action = f"handing {move.fqn} from pipeline rank {move.source} to {move.target} (a new cut)"
        if move.source == me:
            tensors = _local_parts(state[move.fqn])
            if tensors:
                transport.send(tensors, layout.pipeline_ranks[move.target], STATE_TAG + index, action)
        elif move.target == me:
            meta, what = state[move.fqn], sent[move.fqn]
            shape, device = what.local_shape, device_for(layout.pp_group)
            like = [torch.empty(shape, dtype=meta.dtype, device=device)]
            if what.grad_dtype is not None:
                like.append(torch.empty(shape, dtype=what.grad_dtype, device=device))
            if shape.numel():
                pending = transport.post_recv(like, layout.pipeline_ranks[move.source], STATE_TAG + index, action)
                like = transport.wait(pending, action)
            arrived[move.fqn] = _rebuilt(meta, like, what.dtensor, layout)
            if what.unfilled:
                ownership.unfilled.add(move.fqn)
    transport.complete_messages()
    placement.replace_tensors(module, arrived)
    placement.replace_tensors(module, {fqn: _meta_like(state[fqn]) for fqn in dropped})
    ownership.unfilled -= dropped


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous()


def _local_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor's own values and its gradient's, this replica's shard of each under "shard"
    (nothing where the shard is empty)."""
    parts = [_local(tensor)]
    if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
        parts.append(_local(tensor.grad))
    return [] if parts[0].numel() == 0 else parts


def _rebuilt(meta: torch.Tensor, received: list[torch.Tensor], dtensor: _Layout | None, layout: Layout) -> torch.Tensor:
    """The module's new tensor from what arrived: a parameter (with its gradient where one came)
    or a buffer, as the DTensor `dtensor` over the layout's mesh where the sender's was one."""

    def whole(local: torch.Tensor) -> torch.Tensor:
        if dtensor is None:
            return local
        mesh = layout.mesh[dtensor.dims] if len(dtensor.dims) > 1 else layout.mesh[dtensor.dims[0]]
        return DTensor.from_local(
            local, mesh, dtensor.placements, run_check=False, shape=dtensor.shape, stride=dtensor.stride
        )

    if not isinstance(meta, nn.Parameter):
        return whole(received[0])
    param = nn.Parameter(whole(received[0]), requires_grad=meta.requires_grad)
    if len(received) > 1:
        param.grad = whole(received[1])
    return param


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
