"""The module's parameters and buffers as this process holds them: the FQNs it holds once a
distributed compile placed them (`held`), those materialised from `meta` that nothing filled yet
(`unfilled`), what the runtime computes with (`state`), and the state-dict views and loading
that follow from what is held.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from zbcompile.options import PipelineOptions
from zbcompile.passes import tensor_parallel
from zbcompile.runtime.parallel import sharding
from zbcompile.runtime.parallel.layout import Layout
from zbcompile.runtime.state import placement
from zbcompile.value_names import buffer_name, param_name


class StateOwnership:
    """What this process holds of `module` under `options`. `held`: the FQNs this rank holds once
    a distributed compile placed them (None before, and in one process); `unfilled`: the tensors
    materialised from `meta` that neither `init_fn` nor a state dict filled yet."""

    def __init__(self, module: nn.Module, options: PipelineOptions) -> None:
        self.module = module
        self.options = options
        self.held: set[str] | None = None
        self.unfilled: set[str] = set()

    def state(self) -> dict[str, torch.Tensor]:
        """The module's current parameters and buffers, as the runtime names them (a
        tensor-parallel DTensor as its local shard, `local_state`)."""
        state = {param_name(n): p for n, p in self.module.named_parameters()}
        state.update({buffer_name(n): b for n, b in self.module.named_buffers()})
        return local_state(state)

    def set_grad_dtype(self) -> None:
        """Give every floating-point parameter the `grad_dtype` option (torch's attribute), so
        that `.grad` accumulates and is held in it."""
        dtype = self.options.grad_dtype
        if dtype is None:
            return
        for param in self.module.parameters():
            if param.is_floating_point() and param.grad_dtype != dtype:
                grad, param.grad = param.grad, None
                param.grad_dtype = dtype
                param.grad = None if grad is None else grad.to(dtype)

    def check_filled(self) -> None:
        """Refuse to compute with parameters or buffers materialised from `meta` but never filled."""
        if not self.unfilled:
            return
        names = sorted(self.unfilled)
        owners = sorted({type(self.module.get_submodule(n.rpartition(".")[0])).__name__ for n in names})
        in_state_dict = set(placement.canonical_names(self.module)) & set(self.module.state_dict(keep_vars=True))
        unloadable = [n for n in names if n not in in_state_dict]
        ending = ""
        if len(unloadable) < len(names):
            ending += "; or load them with pipe.load_state_dict(state_dict) after compile()"
        if unloadable:
            ending += f". No state dict holds {unloadable[:4]} (non-persistent buffers): only init_fn can fill them"
        raise ValueError(
            f"{len(names)} parameters or buffers this process uses were built on the meta device and neither "
            f"initialised nor loaded, e.g. {names[:4]} (owned by {', '.join(owners[:4])}). Pass init_fn= to "
            "pipeline(): a function that fills one module's own parameters and buffers, such as a transformers "
            "model's _init_weights (without it, a module's reset_parameters() fills its parameters and the buffers "
            "it writes)" + ending
        )

    def held_only(self, named: Iterator[tuple[str, Any]], prefix: str) -> Iterator[tuple[str, Any]]:
        """The (name, tensor) of `named` (a module's `named_parameters(prefix)` or buffers) this
        rank holds: all of them in one process."""
        distributed = self.options.distributed
        if distributed:
            self.require_placed()
        for name, tensor in named:
            if not distributed or name.removeprefix(prefix + "." if prefix else "") in self.held:
                yield name, tensor

    def held_only_entries(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of the module's `state_dict` whose tensors this process holds (every alias
        of a tied weight on every rank that uses it): all of them in one process, or before a
        distributed compile placed the parameters."""
        if self.held is None:
            return state_dict
        aliases = placement.canonical_names(self.module)
        return {k: v for k, v in state_dict.items() if aliases.get(k, k) in self.held}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool) -> Any:
        """Copy into the parameters and buffers this process holds their entries of `state_dict`
        (a full state dict, or any holding them; other ranks' entries are skipped), materialising
        those still on the `meta` device. With `strict`, a missing entry this process uses, or
        one the model does not have, raises. In a distributed run with a model on `meta`, call
        it after compiling (which decides what each rank holds)."""
        if self.held is None and self.options.distributed:  # every rank holds the whole model until compiled
            if any(t.is_meta for t in placement.state_tensors(self.module).values()):
                self.require_placed()
            return self.module.load_state_dict(state_dict, strict=strict)
        held = self.held if self.held is not None else set(placement.canonical_names(self.module).values())
        state_dict = sharding.as_shards(state_dict, self.module)
        result, loaded = placement.load_held(self.module, state_dict, held, strict)
        self.unfilled -= loaded
        return result

    def require_placed(self) -> None:
        if self.held is None:
            raise RuntimeError(
                "in a distributed run each rank holds only its stages' parameters, which are known after "
                "compiling: call pipe.compile(batch, target=...) (or step()) before parameters(), state_dict(), "
                "load_state_dict() of a model on the meta device, or building the optimizer"
            )

    def check_shardable(self, layout: Layout) -> None:
        """data_parallel="shard" needs replicas on a DeviceMesh with a "dp" dimension, and every
        parameter a leading dimension (checked on every rank, before any rank places its own)."""
        if self.options.data_parallel != "shard":
            return
        for name, param in self.module.named_parameters():
            sharding.check_shardable(name, param)
        if layout.dp_size < 2 or layout.mesh is None:
            raise ValueError(
                f"data_parallel='shard' shards parameters over data-parallel replicas, but this pipeline has "
                f"{layout.dp_size} replica{'s' if layout.dp_size > 1 else ''}"
                f"{'' if layout.mesh is not None else ' and no DeviceMesh'}; launch a multiple of {layout.pp_size} "
                "processes (the default ('dp', 'pp') mesh) or pass process_group=<DeviceMesh with 'dp' and 'pp'>, "
                "or use data_parallel='replicate'"
            )

    def place(
        self, held: set[str], device: torch.device, move_others: bool, then: Callable[[], Any] = lambda: None
    ) -> Any:
        """Materialise and fill what this process holds (`placement.placed`), then run `then()`;
        if either raises, the module keeps the tensors it had."""
        with placement.placed(self.module, held, device, self.options.init_fn, move_others) as unfilled:
            result = then()
        self.unfilled |= unfilled
        if move_others:
            self.held = set(held)
        return result


def local_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (runtime names -> parameters and buffers) as the stage programs compute with it: a
    DTensor over "tp" alone as its local shard (a view: in-place writes reach the parameter), one
    over ("dp", "tp") as a DTensor over "dp" of its local shard (as `sharding.Gathered` gathers
    data_parallel="shard"'s parameters), each carrying its `grad_dtype`; every other tensor as it is."""
    result = dict(state)
    for name, tensor in state.items():
        if not isinstance(tensor, DTensor) or not tensor_parallel.is_tensor_parallel(tensor):
            continue
        with torch.no_grad():
            if tensor.device_mesh.mesh_dim_names == (tensor_parallel.TP,):
                local = tensor_parallel.local_view(tensor)
            else:  # over ("dp", "tp"): the local shard's rows over "dp", which a step gathers
                whole = tensor_parallel.local_view(tensor)
                stride = torch.empty(whole.shape, device="meta").stride()
                mesh = tensor.device_mesh["dp"]
                local = DTensor.from_local(
                    tensor.to_local(), mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=stride
                )
        local.grad_dtype = tensor.grad_dtype
        result[name] = local
    return result
