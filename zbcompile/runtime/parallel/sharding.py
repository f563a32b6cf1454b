"""`data_parallel="shard"`: a rank's parameters kept as DTensors sharded over the replicas, as
FSDP2 keeps them, and gathered whole for the step.

Each parameter this rank holds is replaced, at every place the module registers it, by an
`nn.Parameter` wrapping `DTensor.from_local(rows, mesh["dp"], [Shard(0)])`: replica d keeps the
d-th of `dp` chunks of its leading dimension (torch.chunk's split, DTensor's own: a leading
dimension dp does not divide gives the last replicas fewer rows, down to none). So
`pipe.parameters()`, torch.optim optimizers (foreach and fused), `clip_grad_norm_`,
`state_dict()` and torch.distributed.checkpoint see FSDP2's representation, with its gradients
`param.grad` as DTensors of the same sharding.

A step gathers each stage's parameters with one asynchronous all-gather per stage (and dtype;
posted when the step starts, all stages at once; `Gathered` waits for a stage's when one of its parameters is
first read, that is before the stage's first action), keeps them whole for the step (what
torchtitan does under pipelining: reshard_after_forward=False) and drops them after the stage's
last W or B (`Gathered.release`). A gathered tensor carries its parameter's `grad_dtype`, so a
stage accumulates gradients in it and they are reduce-scattered in it (`ReduceScatterLayout`),
as "replicate" all-reduces them. Both
collectives work on rows padded to ceil(rows / dp) per replica, as FSDP2 pads; gloo and NCCL run
them natively (`all_gather_single`, `reduce_scatter_single`), one code path."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from zbcompile import _torch_internals as ti
from zbcompile.value_names import param_name


@dataclass(frozen=True)
class Rows:
    """How a parameter of leading dimension `total` is cut over `dp` replicas: `padded` rows per
    replica in the collectives; replica d holds rows [d * padded, d * padded + local(d)).
    (`inspect.text.state_rows` counts memory with the same `padded`.)"""

    total: int
    dp: int

    @property
    def padded(self) -> int:
        return math.ceil(self.total / self.dp)

    def local(self, replica: int) -> int:
        return max(0, min(self.padded, self.total - replica * self.padded))


def check_shardable(name: str, tensor: torch.Tensor) -> None:
    """A parameter without a leading dimension cannot be sharded: refused, naming it."""
    if tensor.dim() == 0:
        raise ValueError(
            f"data_parallel='shard' shards every parameter along its first dimension, but parameter {name!r} is a "
            "scalar; make it a tensor of shape (1,), or use data_parallel='replicate'"
        )


def shard_of(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`full` (the same on every replica of `mesh`, a 1-D "dp" mesh) as this replica's Shard(0)."""
    rows = Rows(full.shape[0], mesh.size())
    replica = mesh.get_local_rank()
    start = replica * rows.padded
    local = full.detach()[start : start + rows.local(replica)].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def shard_of_parallel(param: DTensor, mesh: DeviceMesh) -> DTensor:
    """A tensor-parallel parameter (a DTensor over `mesh["tp"]`, the same on every replica) as this
    replica's rows of its local shard: a DTensor over `mesh` ("dp", "tp"), as FSDP2 shards it
    (rows of a shard cut on its first dimension: `_StridedShard` over "dp")."""
    placement = param.placements[0]
    local = param.to_local()
    rows = Rows(local.shape[0], mesh["dp"].size())
    replica = mesh.get_local_rank("dp")
    start = replica * rows.padded
    mine = local.detach()[start : start + rows.local(replica)].clone()
    tp = mesh["tp"].size()
    over_dp = ti.strided_shard(0, tp) if placement.is_shard() and placement.dim == 0 else Shard(0)
    return DTensor.from_local(
        mine, mesh, [over_dp, placement], run_check=False, shape=param.shape, stride=param.stride()
    )


def shard_parameters(module: nn.Module, held: set[str], mesh: DeviceMesh) -> None:
    """Replace every parameter of `module` that `held` names (canonical FQNs, `placement`) and
    that is not sharded over "dp" yet by its shard over the "dp" dimension of `mesh` (a
    tensor-parallel parameter by its shard over "dp" and "tp", `shard_of_parallel`), at every
    place it is registered (tied aliases stay one parameter)."""
    over_dp = lambda p: isinstance(p, DTensor) and "dp" in (p.device_mesh.mesh_dim_names or ())  # noqa: E731
    params = {n: p for n, p in module.named_parameters() if n in held and not over_dp(p)}
    for name, param in params.items():
        check_shardable(name, param)

    def sharded_value(param: torch.Tensor) -> DTensor:
        if isinstance(param, DTensor):
            return shard_of_parallel(param, mesh["dp", "tp"])
        return shard_of(param, mesh["dp"])

    sharded = {id(p): nn.Parameter(sharded_value(p), requires_grad=p.requires_grad) for p in params.values()}
    for owner in module.modules():
        for leaf, param in list(owner._parameters.items()):
            if param is not None and id(param) in sharded:
                owner._parameters[leaf] = sharded[id(param)]


def as_shards(state_dict: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """`state_dict` with each whole tensor whose parameter in `module` is a DTensor (sharded over
    the replicas, the tensor-parallel ranks or both) cut to this rank's shard of it, as a DTensor
    of the parameter's layout (torch's `distribute_tensor`, each rank cutting its own: no
    communication), so that `module.load_state_dict` copies shard to shard; a whole tensor must be
    the same on every rank (a full state dict is)."""
    targets = module.state_dict(keep_vars=True)
    result = dict(state_dict)
    for key, value in state_dict.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            result[key] = distribute_tensor(
                value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            )
    return result


class _StageGather:
    """Parameters of one stage and dtype, gathered by one asynchronous all-gather of their padded shards."""

    def __init__(self, names: Sequence[str], params: Sequence[DTensor], group: dist.ProcessGroup) -> None:
        self.names, self.params = list(names), list(params)
        dp = dist.get_world_size(group)
        self.rows = [Rows(p.shape[0], dp) for p in params]
        self.widths = [r.padded * math.prod(p.shape[1:]) for r, p in zip(self.rows, params)]
        pieces = []
        for p, width in zip(params, self.widths):
            local = p.detach().to_local().reshape(-1)
            padding = width - local.numel()
            pieces.append(local if padding == 0 else torch.cat([local, local.new_zeros(padding)]))
        send = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
        self.received = send.new_empty(dp * send.numel())
        self.work = dist.all_gather_single(self.received, send, group=group, async_op=True)

    def unpack(self, timeout: timedelta) -> dict[str, torch.Tensor]:
        wait(self.work, timeout, f"gathering the parameters {self.names[:3]}")
        by_replica = self.received.view(-1, sum(self.widths))
        offset, result = 0, {}
        for name, p, rows, width in zip(self.names, self.params, self.rows, self.widths):
            block = by_replica[:, offset : offset + width].reshape(-1, *p.shape[1:])
            result[name] = block[: rows.total].clone()
            result[name].grad_dtype = p.grad_dtype  # gradients accumulate in the parameter's grad_dtype
            offset += width
        self.received = None
        return result


class Gathered(Mapping):
    """The state a step computes with: `state` (runtime names -> tensors) where every DTensor
    parameter reads as its whole tensor, gathered per stage (`stage_params`: stage -> its
    parameters' runtime names, in the order stages come first) and waited for on first read."""

    def __init__(
        self, state: Mapping[str, torch.Tensor], stage_params: Mapping[int, Sequence[str]], group: dist.ProcessGroup,
        timeout: timedelta,
    ) -> None:
        self._values = {k: v for k, v in state.items() if not isinstance(v, DTensor)}
        self._sharded = {k for k, v in state.items() if isinstance(v, DTensor)}
        self._pending: dict[str, _StageGather] = {}
        self._timeout = timeout
        for names in stage_params.values():
            mine = [n for n in names if n in self._sharded and n not in self._pending]
            for dtype in dict.fromkeys(state[n].dtype for n in mine):  # one gather per stage and dtype
                same = [n for n in mine if state[n].dtype == dtype]
                self._pending.update(dict.fromkeys(same, _StageGather(same, [state[n] for n in same], group)))

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._values.get(name)
        if value is not None:
            return value
        gather = self._pending.get(name)
        if gather is None:
            if name in self._sharded:
                raise RuntimeError(f"{name} was read after the step released its gathered value")
            raise KeyError(name)
        self._values.update(gather.unpack(self._timeout))
        for n in gather.names:
            del self._pending[n]
        return self._values[name]

    def release(self, fqns: Sequence[str]) -> None:
        """Drop the gathered values of parameters `fqns` (their stage's last W or B has run)."""
        for fqn in fqns:
            if param_name(fqn) in self._sharded:
                self._values.pop(param_name(fqn), None)

    def __iter__(self) -> Iterator[str]:
        return iter({*self._values, *self._sharded})

    def __len__(self) -> int:
        return len({*self._values, *self._sharded})


class ReduceScatterLayout:
    """How a bucket of whole gradients becomes this replica's summed shards: the input holds,
    per replica in turn, every gradient's padded rows for that replica; the output is this
    replica's padded rows of each, one after the other."""

    def __init__(self, grads: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.dp, self.replica = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [g.shape for g in grads]
        self.rows = [Rows(g.shape[0], self.dp) for g in grads]
        self.widths = [r.padded * math.prod(s[1:]) for r, s in zip(self.rows, self.shapes)]

    def input(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        padded = []
        for g, rows in zip(grads, self.rows):
            extra = rows.padded * self.dp - rows.total
            padded.append(g if extra == 0 else torch.cat([g, g.new_zeros(extra, *g.shape[1:])]))
        return torch.cat([p.reshape(self.dp, -1) for p in padded], dim=1).reshape(-1)

    def output(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_empty(sum(self.widths))

    def shards(self, output: torch.Tensor, mesh: DeviceMesh) -> list[DTensor]:
        """Each gradient's shard of `output` (after the reduce-scatter) as a DTensor."""
        result, offset = [], 0
        for shape, rows, width in zip(self.shapes, self.rows, self.widths):
            local = output[offset : offset + width].view(rows.padded, *shape[1:])[: rows.local(self.replica)]
            stride = torch.empty(shape, device="meta").stride()
            result.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride))
            offset += width
        return result


def wait(work: dist.Work, timeout: timedelta, what: str, over: str = "data-parallel") -> None:
    """Wait for a collective over the replicas (or the `over` ranks), failing with the rank and
    `what` after `timeout`."""
    failure = f"rank {dist.get_rank()}: {what} over the {over} ranks did not complete"
    try:
        completed = work.wait(timeout)
    except RuntimeError as error:
        raise RuntimeError(f"{failure} ({str(error).splitlines()[0]}); a rank may have died or diverged") from error
    if completed is False:
        raise RuntimeError(f"{failure} within {timeout}; a rank may have died or diverged")
