"""Point-to-point messages between pipeline ranks over torch.distributed, with a timeout on
every wait and errors that name the peer and the action. The device follows the process
group's backend (CPU for gloo, the current CUDA device for NCCL): one code path for both."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist


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


class PeerError(RuntimeError):
    """A message did not arrive (timeout) or its peer went away."""


@dataclass
class Pending:
    """Posted receives or sends of one message."""

    works: list
    tensors: list[torch.Tensor]
    peer: int
    action: str


class Transport:
    """Sends and receives the tensors of one message (several tensors to one peer are posted as
    one batch). Every wait gives up after `timeout` and raises a PeerError naming the peer rank
    and the action that was waiting."""

    def __init__(self, rank: int, timeout: timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        self._sends: list[Pending] = []

    @functools.cached_property
    def matches_by_tag(self) -> bool:
        """gloo pairs a send with its receive by tag; NCCL (and the others) by order per peer."""
        return dist.get_backend() == "gloo"

    def post_recv(self, buffers: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> Pending:
        return Pending(self._post(dist.irecv, buffers, peer, tag, action), list(buffers), peer, action)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> None:
        tensors = [t.contiguous() for t in tensors]
        self._sends.append(Pending(self._post(dist.isend, tensors, peer, tag, action), tensors, peer, action))

    def wait(self, pending: Pending, waiting_action: str) -> list[torch.Tensor]:
        for work in pending.works:
            self._wait_one(work, pending.peer, f"{waiting_action} (waiting for {pending.action})")
        return pending.tensors

    def flush_sends(self) -> None:
        """Wait for every send posted so far (their tensors can then be freed)."""
        sends, self._sends = self._sends, []
        for pending in sends:
            for work in pending.works:
                self._wait_one(work, pending.peer, pending.action)

    def _post(self, op, tensors: Sequence[torch.Tensor], peer: int, tag: int, action: str) -> list:
        """Post `op` (dist.isend or dist.irecv) for every tensor; several go as one batch."""
        try:
            if len(tensors) <= 1:  # batching costs more than a single message on CPU
                return [op(t, peer, tag=tag) for t in tensors]
            return dist.batch_isend_irecv([dist.P2POp(op, t, peer, tag=tag) for t in tensors])
        except RuntimeError as error:
            raise PeerError(f"rank {self.rank}: posting {action} to/from rank {peer} failed: {error}") from error

    def _wait_one(self, work, peer: int, action: str) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise PeerError(
                f"rank {self.rank}: {action} failed on its message with rank {peer} "
                f"(peer rank {peer} may have died or timed out after {self.timeout.total_seconds():.0f} s): "
                f"{str(error).splitlines()[0]}"
            ) from error
        if completed is False:
            raise PeerError(
                f"rank {self.rank}: timed out after {self.timeout.total_seconds():.0f} s in {action} "
                f"waiting for peer rank {peer}"
            )
