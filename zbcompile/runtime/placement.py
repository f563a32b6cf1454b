"""Which parameters and buffers a rank holds: materialise the ones its stages use (a model may
be built on the `meta` device), move the others to `meta` so that no rank keeps the whole
model, and say which entries of the state dict a rank reports."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zbcompile.compiler import CompiledPipeline
from zbcompile.schedules import Schedule


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Every name of every parameter and buffer (tied weights have several) -> the name
    `named_parameters()`/`named_buffers()` report for it."""
    result = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            result[name] = first.setdefault(id(tensor), name)
    return result


def _locations(module: nn.Module, canonical: str, aliases: dict[str, str]) -> list[tuple[nn.Module, str]]:
    places = []
    for name, target in aliases.items():
        if target == canonical:
            owner, _, leaf = name.rpartition(".")
            places.append((module.get_submodule(owner), leaf))
    return places


def _replace(module: nn.Module, canonical: str, aliases: dict[str, str], value: torch.Tensor) -> None:
    """Put `value` at every place that holds `canonical` (so tied weights stay tied)."""
    for owner, leaf in _locations(module, canonical, aliases):
        if leaf in owner._parameters:
            owner._parameters[leaf] = value
        else:
            owner._buffers[leaf] = value


def _like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty_like(tensor, device=device)
    return nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new


def place_state(module: nn.Module, used: set[str], device: torch.device) -> set[str]:
    """Keep on `device` exactly the parameters and buffers named in `used` (canonical FQNs):
    ones on `meta` are materialised and initialised by their modules' `reset_parameters()`;
    the rest move to `meta`. Returns `used`."""
    aliases = canonical_names(module)
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    to_init: list[nn.Module] = []
    for name, tensor in state.items():
        if name in used and tensor.is_meta:
            _replace(module, name, aliases, _like(tensor, device))
            owner = module.get_submodule(name.rpartition(".")[0])
            if not hasattr(owner, "reset_parameters"):
                raise ValueError(
                    f"'{name}' is on the meta device and its module ({type(owner).__name__}) has no "
                    "reset_parameters() to initialise it; load weights with pipe.load_state_dict(..., strict=False)"
                )
            if owner not in to_init:
                to_init.append(owner)
        elif name in used and tensor.device != device:
            moved = tensor.detach().to(device)
            _replace(module, name, aliases, nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved)
        elif name not in used and not tensor.is_meta:
            _replace(module, name, aliases, _like(tensor, torch.device("meta")))
    with torch.no_grad():
        for owner in to_init:
            owner.reset_parameters()
    return set(used)


def owned_names(compiled: CompiledPipeline, schedule: Schedule, pp_rank: int) -> set[str]:
    """Canonical FQNs this pipeline rank reports: those whose first user stage is on it
    (parameters no stage uses belong to the first rank)."""
    first_user: dict[str, int] = {}
    for stage in compiled.partition.stages:
        for fqn in (*stage.param_fqns, *stage.buffer_fqns):
            first_user.setdefault(fqn, stage.index)
    everything = (*compiled.traced.param_fqns, *compiled.traced.buffer_fqns)
    return {f for f in everything if schedule.stage_to_rank[first_user.get(f, 0)] == pp_rank}


def load_local(module: nn.Module, state_dict: dict[str, Any], local: set[str], strict: bool) -> Any:
    """Copy the entries of `state_dict` that this rank holds; with strict=True every held
    tensor must be present."""
    aliases = canonical_names(module)
    wanted = {k: v for k, v in state_dict.items() if aliases.get(k, k) in local}
    missing = sorted(local - {aliases.get(k, k) for k in wanted})
    if strict and missing:
        raise KeyError(f"state_dict lacks entries this rank holds: {missing}")
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    with torch.no_grad():
        for key, value in wanted.items():
            state[aliases.get(key, key)].copy_(value)
    return missing
