"""Parameters held by several ranks of one pipeline (a tied embedding and LM head; under a
mirrored schedule such as dualpipe, every parameter, since both copies of the pipeline run each
stage, on two ranks): which ranks hold each, which rank owns it, and the point-to-point messages
that keep the copies equal.

No process group is created for them: the owner (the rank of the weight's first stage) gathers
the other holders' gradients, sums them in pipeline order (its own first; of a stage's two ranks,
the first copy's first) and sends the sum back,
so every holder gets the same bits under every schedule; at start-up it sends its value to the
others. Messages go through the pipeline's `Transport` (timeouts, errors that name the peer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from zbcompile.passes.partition import StagePartition
from zbcompile.runtime.step.transport import Transport
from zbcompile.value_names import param_name

TIED_TAG = 1 << 25  # above every tag of a step's messages and of post-validation's


@dataclass(frozen=True)
class TiedWeight:
    """Parameter `fqn`, held by the global ranks `holders` (in pipeline order); `holders[0]`
    owns it (its `state_dict()` entry and its gradient norm)."""

    fqn: str
    holders: tuple[int, ...]

    @property
    def owner(self) -> int:
        return self.holders[0]


def parameter_users(partition: StagePartition) -> dict[str, tuple[int, ...]]:
    """Every parameter's FQN -> the stages using it (in stage order)."""
    users = dict(partition.shared_params)
    for stage in partition.stages:
        for fqn in stage.param_fqns:
            users.setdefault(fqn, (stage.index,))
    return users


def tied_weights(
    users: Mapping[str, Sequence[int]], ranks_of: Callable[[int], Sequence[int]], pipeline_ranks: Sequence[int],
    rank: int,
) -> list[TiedWeight]:
    """The parameters used by stages on several ranks that `rank` holds, sorted by FQN.
    `users` maps an FQN to the stages using it, `ranks_of(stage)` gives the pipeline positions
    running a stage (`Schedule.ranks_of`)."""
    weights = []
    for fqn, stages in sorted(users.items()):
        holders = tuple(pipeline_ranks[p] for p in holder_positions(stages, ranks_of))
        if len(holders) > 1 and rank in holders:
            weights.append(TiedWeight(fqn, holders))
    return weights


def holder_positions(stages: Sequence[int], ranks_of: Callable[[int], Sequence[int]]) -> list[int]:
    """The pipeline positions holding a parameter that `stages` use, in pipeline order: by
    stage, and of a stage's ranks (`ranks_of`), copy 0's first. The first is the owner."""
    return list(dict.fromkeys(p for s in sorted(stages) for p in ranks_of(s)))


def share_owner_values(weights: Sequence[TiedWeight], state: Mapping[str, torch.Tensor], transport: Transport) -> None:
    """Every holder's copy takes the owner's value (each rank may have initialised its own)."""
    for index, weight in enumerate(weights):
        value = state[param_name(weight.fqn)]
        action = f"sharing tied weight {weight.fqn}"
        if transport.rank == weight.owner:
            for holder in weight.holders[1:]:
                transport.send([value.detach()], holder, TIED_TAG + index, action)
            transport.complete_messages()
        else:
            received = _receive(transport, value, weight.owner, TIED_TAG + index, action)
            with torch.no_grad():
                value.copy_(received)


def sum_gradients(
    weights: Sequence[TiedWeight], grads: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor],
    transport: Transport,
) -> None:
    """Replace each tied weight's gradient in `grads` by the sum over its holders (a holder whose
    stages gave it none counts zeros), the same tensor values on every holder."""
    for index, weight in enumerate(weights):
        own = grads.get(weight.fqn)
        if own is None:
            own = torch.zeros_like(state[param_name(weight.fqn)])
        action = f"summing the gradient of tied weight {weight.fqn}"
        if transport.rank == weight.owner:
            total = own.clone()
            for holder in weight.holders[1:]:
                total += _receive(transport, own, holder, TIED_TAG + index, action)
            for holder in weight.holders[1:]:
                transport.send([total], holder, TIED_TAG + index, action)
            transport.complete_messages()
        else:
            transport.send([own], weight.owner, TIED_TAG + index, action)
            total = _receive(transport, own, weight.owner, TIED_TAG + index, action)
            transport.complete_messages()
        grads[weight.fqn] = total


def _receive(transport: Transport, like: torch.Tensor, peer: int, tag: int, action: str) -> torch.Tensor:
    """A tensor shaped like `like` received from `peer`, once it is there."""
    return transport.wait(transport.post_recv([torch.empty_like(like)], peer, tag, action), action)[0]
