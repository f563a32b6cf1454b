"""Which parameters and buffers a rank holds: materialise the ones its stages use (a model may
be built on the `meta` device) and fill them (an init function, `reset_parameters()`, or the
state dict), move the others to `meta` so that no rank keeps the whole model, and say which
entries of the state dict a rank reports."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from zbcompile import _torch_internals as ti
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


class _Slots:
    """Where each parameter and buffer is registered: a tied weight, or any tensor of a module
    registered under two names, has several places; replacing one replaces it at all of them."""

    def __init__(self, module: nn.Module) -> None:
        self.aliases = canonical_names(module)
        self.places: dict[str, list[tuple[dict, str]]] = {}
        for name, canonical in self.aliases.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            if not any(t is table and l == leaf for t, l in self.places.get(canonical, [])):
                self.places.setdefault(canonical, []).append((table, leaf))

    def replace(self, canonical: str, value: torch.Tensor) -> None:
        for table, leaf in self.places[canonical]:
            table[leaf] = value


def replace_tensors(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put each of `tensors` (by canonical FQN) in its parameter's or buffer's place, at every
    place the module registers it (a tied weight's aliases too)."""
    if not tensors:
        return
    slots = _Slots(module)
    for name, tensor in tensors.items():
        slots.replace(name, tensor)


def _like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty_like(tensor, device=device)
    return nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical FQN -> parameter or buffer."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@contextlib.contextmanager
def placed(
    module: nn.Module,
    held: set[str],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
    move_others: bool = True,
):
    """Keep on `device` the parameters and buffers named in `held` (canonical FQNs); with
    `move_others`, those on another device move there and the rest move to `meta`. Held tensors on
    `meta` are materialised (uninitialised memory) and then filled by `init_fn(owner)` for each
    module owning one, or else by the owner's `reset_parameters()` (see `_initialise`). Yields the
    names left unfilled: the state dict must provide them (`load_state_dict`). If `init_fn`,
    `reset_parameters()` or the body of the `with` raises, every module gets back the tensors it
    had."""
    slots = _Slots(module)
    before = state_tensors(module)
    materialised: list[str] = []
    try:
        for name, tensor in before.items():
            if name in held and tensor.is_meta:
                slots.replace(name, _like(tensor, device))
                materialised.append(name)
            elif move_others and name in held and tensor.device != device:
                moved = tensor.detach().to(device)
                slots.replace(
                    name, nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
                )
            elif move_others and name not in held and not tensor.is_meta:
                slots.replace(name, _like(tensor, torch.device("meta")))
        yield _initialise(module, materialised, init_fn)
    except BaseException:
        for name, tensor in before.items():
            slots.replace(name, tensor)
        raise


def _initialise(module: nn.Module, names: list[str], init_fn: Callable[[nn.Module], None] | None) -> set[str]:
    """Fill the freshly materialised `names` (see `placed`); returns those left unfilled. A
    buffer counts as filled by `reset_parameters()` only if it wrote into it (BatchNorm's running
    statistics; not a mask its module computed in `__init__`)."""
    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    state = state_tensors(module)
    parameters = dict(module.named_parameters())
    unfilled: set[str] = set()
    with torch.no_grad():
        for owner_name, owned in owners.items():
            owner = module.get_submodule(owner_name)
            if init_fn is not None:
                init_fn(owner)
            elif hasattr(owner, "reset_parameters"):
                buffers = {n: ti.version_of(state[n]) for n in owned if n not in parameters}
                owner.reset_parameters()
                unfilled.update(n for n, version in buffers.items() if ti.version_of(state[n]) == version)
            else:
                unfilled.update(owned)
    return unfilled


def owned_names(compiled: CompiledPipeline, schedule: Schedule, pp_rank: int) -> set[str]:
    """Canonical FQNs this pipeline rank reports: those whose first user stage is on it
    (parameters no stage uses belong to the first rank)."""
    first_user: dict[str, int] = {}
    for stage in compiled.partition.stages:
        for fqn in (*stage.param_fqns, *stage.buffer_fqns):
            first_user.setdefault(fqn, stage.index)
    everything = (*compiled.traced.param_fqns, *compiled.traced.buffer_fqns)
    return {f for f in everything if schedule.stage_to_rank[first_user.get(f, 0)] == pp_rank}


class LoadResult(NamedTuple):
    """What `load_held` did not match, as `nn.Module.load_state_dict` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_held(
    module: nn.Module, state_dict: Mapping[str, Any], held: set[str], strict: bool
) -> tuple[LoadResult, set[str]]:
    """Load into the tensors named in `held` (canonical FQNs) their entries of `state_dict`,
    under any of their names, with the module's own `load_state_dict`; a held tensor still on
    `meta` is materialised first, on the entry's device. Entries for tensors not held here
    (other ranks') are skipped. Missing keys: held persistent entries absent from `state_dict`;
    unexpected keys: entries the module does not have. With `strict`, either raises a
    ValueError. Returns the report and the canonical names loaded."""
    slots = _Slots(module)
    aliases = slots.aliases
    entries = set(module.state_dict(keep_vars=True))
    mine = {k: v for k, v in state_dict.items() if aliases.get(k) in held or (k in entries and k not in aliases)}
    loaded = {aliases[k] for k in mine if k in aliases}
    result = LoadResult(
        missing_keys=sorted((held & {aliases.get(k, k) for k in entries}) - loaded),
        unexpected_keys=sorted(k for k in state_dict if k not in aliases and k not in entries),
    )
    if strict and (result.missing_keys or result.unexpected_keys):
        raise ValueError(
            f"load_state_dict: the state dict lacks {len(result.missing_keys)} entries this rank's stages use "
            f"{result.missing_keys[:6]} and has {len(result.unexpected_keys)} the model does not know "
            f"{result.unexpected_keys[:6]}; pass the full state dict (or one holding every entry this rank uses), "
            "or strict=False to load what matches"
        )
    state = state_tensors(module)
    for key, value in mine.items():
        name = aliases.get(key)
        if name is not None and state[name].is_meta:
            state[name] = _like(state[name], value.device)
            slots.replace(name, state[name])
    module.load_state_dict(mine, strict=False)
    return result, loaded
