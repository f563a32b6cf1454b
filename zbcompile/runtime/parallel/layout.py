"""Where this rank sits among the pipelines (`Layout`, made by `make_layout` from the process group
or DeviceMesh given to `pipeline()`): its pipeline position, data-parallel replica and
tensor-parallel rank, with the process groups of each, and how one rank's decision reaches every
rank (`from_first_rank`), the backend's device (`device_for`) and every rank's value gathered
(`gather_objects`): every adaptive choice (the cut, a re-solved schedule, recompute levels)
is taken on the world's first rank (`Layout.decides`) and broadcast, so that the tensor-parallel
ranks of a stage run the same programs in the same order (their collectives pair up) and the
replicas post their gradient reductions in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zbcompile._torch_internals import default_store
from zbcompile.runtime.parallel.cuda_device import claim_device

MESH_DIMENSIONS = ("dp", "pp", "tp")  # a DeviceMesh given to pipeline(): any of these, in this order


def device_for(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors must live for `group`'s backend."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_objects(value: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's `value` over `group`, in group order (a collective of its ranks); `[value]`
    when `group` is None (a pipeline of this rank alone)."""
    if group is None:
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


@dataclass(frozen=True)
class Layout:
    """This rank's place: `pp_rank` in a pipeline of `pp_size` ranks, replica `dp_rank` of
    `dp_size`, tensor-parallel rank `tp_rank` of `tp_size`. `pipeline_ranks[i]` is the global rank
    of pipeline position i in this replica (and tensor-parallel rank), `replica_ranks[d]` the
    global rank of this position in replica d; `pp_group`, `dp_group` and `tp_group` are process
    groups over the ranks of each dimension that this rank belongs to (None where they would hold
    this rank alone). `mesh` is the ("dp", "pp"[, "tp"]) DeviceMesh they come from, where there is
    one."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    pipeline_ranks: tuple[int, ...]
    replica_ranks: tuple[int, ...]
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh | None
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None

    @property
    def decides(self) -> bool:
        """Whether this rank takes the decisions every rank follows: the first pipeline position
        of the first replica and tensor-parallel rank (global rank 0 of the layout)."""
        return self.pp_rank == 0 and self.dp_rank == 0 and self.tp_rank == 0

    @property
    def decision_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups over which the deciding rank's value reaches every rank: a broadcast from
        the first member of each in turn (replicas, pipeline, tensor-parallel ranks) leaves
        every rank with the value of the rank at position 0 of all three."""
        return tuple(g for g in (self.dp_group, self.pp_group, self.tp_group) if g is not None)


def from_first_rank(value: Any, layout: Layout | None) -> Any:
    """The deciding rank's `value` (`Layout.decides`) on every rank of the layout (the value
    itself in one process): one broadcast per group of `Layout.decision_groups`. Every rank must
    call it at the same point."""
    for group in layout.decision_groups if layout is not None else ():
        box = [value]
        dist.broadcast_object_list(box, group=group, group_src=0)
        value = box[0]
    return value


def make_layout(
    pp_size: int, device: torch.device, description: str, group: dist.ProcessGroup | DeviceMesh | None = None
) -> Layout:
    """The layout of pipelines of `pp_size` ranks over `group`: None (the default group: a
    ("dp", "pp") DeviceMesh over the world, every rank calls this), a process group of one
    pipeline's ranks (in group order), or a DeviceMesh with dimensions among ("dp", "pp", "tp"),
    in that order, "pp" where `pp_size` > 1 (e.g. a slice of a larger mesh). On CUDA (NCCL), this
    rank's device is settled first, one per rank (`cuda_device.claim_device`), before any
    collective."""
    if device.type == "cuda":
        _claim_cuda_device(group)
    if isinstance(group, DeviceMesh):
        return _layout_of_mesh(group, pp_size, description)
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    if group is not None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the process_group given to pipeline(): {ranks}")
        if len(ranks) != pp_size:
            raise ValueError(
                f"process_group of {len(ranks)} ranks does not fit {description}, which needs {pp_size} ranks per "
                "pipeline; give a process group of exactly one pipeline's ranks, or for data-parallel replicas a "
                "DeviceMesh with 'dp' and 'pp' dimensions"
            )
        return Layout(
            pp_size=pp_size, dp_size=1, pp_rank=ranks.index(rank), dp_rank=0, pipeline_ranks=tuple(ranks),
            replica_ranks=(rank,), pp_group=group if pp_size > 1 else None, dp_group=None, mesh=None,
        )
    if len(ranks) % pp_size:
        raise ValueError(
            f"world size {len(ranks)} does not fit {description}, which needs {pp_size} ranks per pipeline; "
            f"launch a multiple of {pp_size} processes (each extra multiple is a data-parallel replica)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = len(ranks) // pp_size
    mesh = init_device_mesh(device.type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = divmod(rank, pp_size)
    return Layout(
        pp_size=pp_size, dp_size=dp_size, pp_rank=pp_rank, dp_rank=dp_rank,
        pipeline_ranks=tuple(dp_rank * pp_size + i for i in range(pp_size)),
        replica_ranks=tuple(d * pp_size + pp_rank for d in range(dp_size)),
        pp_group=mesh.get_group("pp") if pp_size > 1 else None,
        dp_group=mesh.get_group("dp") if dp_size > 1 else None,
        mesh=mesh,
    )


def _claim_cuda_device(group: dist.ProcessGroup | DeviceMesh | None) -> torch.device:
    """This rank's GPU, made current and checked distinct among the ranks of `group` (the world
    for None) through the store, before the first collective."""
    if isinstance(group, DeviceMesh):
        ranks = group.mesh.flatten().tolist()
    else:
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return claim_device(ranks, dist.get_rank(), bound, default_store())


def check_mesh(mesh: DeviceMesh, pp_size: int, description: str) -> tuple[str, ...]:
    """The mesh's dimension names, refused unless they are among ("dp", "pp", "tp") in that order,
    with "pp" of `pp_size` ranks (absent only where `pp_size` is 1), the mesh (or slice) dividing the world."""
    names = tuple(mesh.mesh_dim_names or ())
    ordered = [n for n in MESH_DIMENSIONS if n in names]
    if not names or list(names) != ordered or ("pp" not in names and pp_size > 1):
        raise ValueError(
            f"a DeviceMesh given to pipeline() needs dimensions among {MESH_DIMENSIONS} in that order, 'pp' where "
            f"there are several stages, got {names or 'unnamed dimensions'}; slice a larger mesh, e.g. "
            "mesh['dp', 'pp', 'tp'] or mesh['pp']"
        )
    sizes = dict(zip(names, mesh.shape))
    if sizes.get("pp", 1) != pp_size:
        raise ValueError(
            f"the DeviceMesh's 'pp' dimension has {sizes.get('pp', 1)} ranks but {description} needs {pp_size}"
        )
    world = dist.get_world_size()
    if world % mesh.size():
        shape = " x ".join(f"{n}={sizes[n]}" for n in names)
        raise ValueError(
            f"the DeviceMesh ({shape}, {mesh.size()} ranks) does not divide the world of {world} ranks; launch a "
            f"multiple of {mesh.size()} processes, or build the mesh with sizes whose product divides {world}"
        )
    return names


def _layout_of_mesh(mesh: DeviceMesh, pp_size: int, description: str) -> Layout:
    names = check_mesh(mesh, pp_size, description)
    groups = {n: mesh.get_group(n) for n in names}
    ranks = {n: tuple(dist.get_process_group_ranks(g)) for n, g in groups.items()}
    me = dist.get_rank()

    def ranks_of(name: str) -> tuple[int, ...]:
        """The global ranks along dimension `name` with this rank (this rank alone where absent)."""
        return ranks.get(name, (me,))

    def local_rank(name: str) -> int:
        return mesh.get_local_rank(name) if name in names else 0

    def group_of(name: str) -> dist.ProcessGroup | None:
        """The group along `name`, where it holds more than this rank."""
        return groups[name] if len(ranks_of(name)) > 1 else None

    return Layout(
        pp_size=pp_size, dp_size=len(ranks_of("dp")), pp_rank=local_rank("pp"), dp_rank=local_rank("dp"),
        pipeline_ranks=ranks_of("pp"), replica_ranks=ranks_of("dp"), pp_group=group_of("pp"), dp_group=group_of("dp"),
        mesh=mesh, tp_size=len(ranks_of("tp")), tp_rank=local_rank("tp"), tp_group=group_of("tp"),
    )
