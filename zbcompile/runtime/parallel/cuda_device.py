"""One CUDA device per rank, settled before a pipeline's first collective on NCCL.

NCCL needs every rank of a communicator on its own GPU, and torch puts a rank's CUDA work on the
current device, which is cuda:0 until someone sets it. `claim_device` picks this rank's device:
the one the default process group is bound to (`init_process_group(device_id=...)`), else the
one `LOCAL_RANK` names (torchrun sets it) where the current device was left at cuda:0, else the
current device; makes it current; and checks, through the process group's key-value store (no
collective, which two ranks on one GPU would hang or fail in inside NCCL), that no two ranks of
the pipelines use one device, failing with a ValueError naming both ranks otherwise.

The CUDA calls and the store are parameters, so that a CPU test can substitute them."""

from __future__ import annotations

import os
import socket
from types import ModuleType
from typing import Any, Mapping, Sequence

import torch

KEY = "zbcompile/cuda_device/{rank}"


def choose_device(bound: torch.device | None, cuda: Any = torch.cuda, env: Mapping[str, str] = os.environ) -> int:
    """The index of this rank's device (see the module docstring), made current."""
    if bound is not None:
        index = bound.index if bound.index is not None else cuda.current_device()
    else:
        index = cuda.current_device()
        local = env.get("LOCAL_RANK")
        if local is not None and index == 0 and int(local) < cuda.device_count():
            index = int(local)
    cuda.set_device(index)
    return index


def check_distinct(rank: int, ranks: Sequence[int], identity: str, store: Any) -> None:
    """Publish this rank's device `identity` ("host/uuid") under its rank in `store`, read those
    of `ranks`, and raise a ValueError where another rank has the same one."""
    store.set(KEY.format(rank=rank), identity)
    for other in ranks:
        if other == rank:
            continue
        theirs = store.get(KEY.format(rank=other))
        theirs = theirs.decode() if isinstance(theirs, bytes) else theirs
        if theirs == identity:
            first, second = sorted((rank, other))
            raise ValueError(
                f"ranks {first} and {second} both use the CUDA device {identity.split('/', 1)[-1]} on host "
                f"{identity.split('/', 1)[0]}; NCCL needs one GPU per rank. Launch with torchrun (which sets "
                "LOCAL_RANK, and the pipeline then takes cuda:LOCAL_RANK), call torch.cuda.set_device(local_rank) "
                "before pipeline(), or pass init_process_group(..., device_id=torch.device('cuda', local_rank))"
            )


def claim_device(
    ranks: Sequence[int], rank: int, bound: torch.device | None, store: Any, cuda: ModuleType | Any = torch.cuda
) -> torch.device:
    """This rank's CUDA device, made current and checked distinct among `ranks` (module docstring)."""
    index = choose_device(bound, cuda)
    identity = f"{socket.gethostname()}/{cuda.get_device_properties(index).uuid}"
    check_distinct(rank, ranks, identity, store)
    return torch.device("cuda", index)
