"""Pass: tensor-parallel modules (torch's DTensor plans: `ColwiseParallel`, `RowwiseParallel`,
`SequenceParallel`, `PrepareModuleInput`, ...) traced as one call each, and lowered to their local
computation with torch's collectives when a stage's joint graph is traced.

A module is *tensor-parallel* when it holds DTensor parameters or buffers over the mesh's "tp"
dimension, or carries the input/output hooks `parallelize_module` installs (torch's
`distribute_module`, `PrepareModuleInput`); the outermost such modules are the *calls*. The forward trace
(`passes/trace.py`) records each call of one as a single `zbcompile::tensor_parallel_call` node
whose inputs are the call's tensor arguments and the module's parameters and buffers as this rank
holds them (DTensors as their local shards), and whose outputs are its tensor results (a DTensor
result as its local shard). Between calls the model computes on local tensors, as in eager tensor
parallelism. A stage's joint (`passes/joint.py`) is traced through `lowered(module)`, where each
call runs the module itself on DTensors rebuilt from the local tensors: torch's DTensor autograd
then places every redistribution of the forward and of the backward, and AOTAutograd records them
as `_c10d_functional` collectives and `wait_tensor`s among the local ops of F and of the backward
(a RowwiseParallel output's all-reduce in F; a ColwiseParallel input's gradient all-reduce in the
backward, which `split_backward` keeps in I).

A parameter replicated over "tp" whose gradient comes out a partial sum (a `SequenceParallel`
norm's weight) keeps that local partial sum in W; the stage joint lists it (`partial_grads`) and
the runtime sums it over the tp group after the step, as Megatron-LM reduces its norms' gradients,
so that W holds local work only.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.utils.weak import WeakIdKeyDictionary

from zbcompile import _torch_internals as ti
from zbcompile._torch_internals import pytree

TP = "tp"  # the name of the tensor-parallel dimension of a DeviceMesh


@dataclass(frozen=True)
class LocalSpec:
    """How a local tensor stands for a DTensor over the tp mesh: `placements` over `mesh` (1-D,
    "tp") of a tensor of `shape` and `stride`."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def of(tensor: DTensor) -> "LocalSpec":
        """The tp part of a DTensor's layout (a 2-D ("dp", "tp") DTensor's "tp" placement)."""
        names = tensor.device_mesh.mesh_dim_names or ()
        if names == (TP,):
            return LocalSpec(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride())
        index = names.index(TP)
        return LocalSpec(tensor.device_mesh[TP], (tensor.placements[index],), tensor.shape, tensor.stride())

    def wrap(self, local: torch.Tensor) -> DTensor:
        mesh, placements = self.mesh, self.placements
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=self.shape, stride=self.stride)


def is_tensor_parallel(tensor: Any) -> bool:
    """A DTensor over a mesh with a "tp" dimension."""
    return isinstance(tensor, DTensor) and TP in (tensor.device_mesh.mesh_dim_names or ())


def _has_parallel_hooks(module: nn.Module) -> bool:
    """Whether `module` carries forward hooks of torch's DTensor (`distribute_module`'s, a
    ParallelStyle's such as `PrepareModuleInput`)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(getattr(getattr(h, "func", h), "__module__", "").startswith("torch.distributed.tensor") for h in hooks)


def parallel_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost tensor-parallel modules of `model` by FQN (module docstring)."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f in found) or not name:
            continue
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(is_tensor_parallel(t) for t in own) or _has_parallel_hooks(module):
            found[name] = module
    return found


@dataclass(eq=False)
class ParallelCall:
    """One call of a tensor-parallel module in a trace: `module` (FQN `fqn`) called with
    (args, kwargs) of structure `in_spec`, whose non-tensor leaves are `constants` (None where a
    tensor goes) and whose tensor leaves arrive as local tensors, DTensors per `input_specs`;
    then its `state` (module-relative names; canonical FQNs `state_fqns`), DTensors per
    `state_specs`. The result's structure and the layouts of its DTensor leaves are recorded on
    the first run (`out_spec`, `out_constants`, `output_specs`), with the FLOPs of its local ops."""

    key: str
    fqn: str
    module: nn.Module
    in_spec: Any
    constants: tuple[Any, ...]
    input_specs: tuple[LocalSpec | None, ...]
    state: tuple[str, ...]
    state_fqns: tuple[str, ...]
    state_specs: tuple[LocalSpec | None, ...]
    out_spec: Any = None
    out_constants: tuple[Any, ...] = ()
    output_specs: tuple[LocalSpec | None, ...] = ()
    flops: int = 0

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The module's local results for its local inputs and state (`tensors`, in the op's order)."""
        inputs, state = tensors[: len(self.input_specs)], tensors[len(self.input_specs) :]
        values = {}
        for name, fqn, spec, local in zip(self.state, self.state_fqns, self.state_specs, state):
            values[name] = local if spec is None else _ParameterFromLocal.apply(local, spec, fqn)
        given = iter(spec.wrap(t) if spec is not None else t for spec, t in zip(self.input_specs, inputs))
        args, kwargs = pytree.tree_unflatten([next(given) if c is None else c for c in self.constants], self.in_spec)
        counting = ti.LocalFlopCounter() if self.out_spec is None else contextlib.nullcontext()
        with counting:
            result = torch.func.functional_call(self.module, values, tuple(args), kwargs, strict=False)
        leaves, spec = pytree.tree_flatten(result)
        if self.out_spec is None:
            self.out_spec, self.flops = spec, counting.flops
            self.out_constants = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
            self.output_specs = tuple(
                LocalSpec.of(x) if isinstance(x, DTensor) else None for x in leaves if isinstance(x, torch.Tensor)
            )
        outputs = [x.to_local() if isinstance(x, DTensor) else x for x in leaves if isinstance(x, torch.Tensor)]
        given_ids = {id(t) for t in tensors}
        return [x.clone() if id(x) in given_ids else x for x in outputs]

    def rebuild(self, outputs: list[torch.Tensor]) -> Any:
        """The module's result from the op's outputs (local tensors)."""
        produced = iter(outputs)
        return pytree.tree_unflatten([next(produced) if c is None else c for c in self.out_constants], self.out_spec)


_CALLS: "weakref.WeakValueDictionary[str, ParallelCall]" = weakref.WeakValueDictionary()  # by key
_CALL_NUMBERS = itertools.count()  # a key's number: unique in the process
_partial_grads: list[set[str]] = []  # where the joint traced now records partial gradients (`recording_partial_grads`)


@torch.library.custom_op("zbcompile::tensor_parallel_call", mutates_args=())
def tensor_parallel_call(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """One call of a tensor-parallel module (`ParallelCall`, by `key`), run eagerly on DTensors."""
    return _CALLS[key].run(tensors)


@tensor_parallel_call.register_fake
def _(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return _CALLS[key].run(tensors)


CALL_OP = torch.ops.zbcompile.tensor_parallel_call.default


class _ParameterFromLocal(torch.autograd.Function):
    """A local parameter (or buffer) as its DTensor (`DTensor.from_local`). Its gradient comes back
    in the parameter's layout, except where the parameter is replicated and its gradient a partial
    sum: that stays local, and is recorded (module docstring)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: LocalSpec, fqn: str) -> DTensor:  # noqa: D102
        ctx.spec, ctx.fqn = spec, fqn
        return spec.wrap(local)

    @staticmethod
    def backward(ctx, grad: DTensor | None):  # noqa: D102
        if grad is None:
            return None, None, None
        spec = ctx.spec
        partial = [g.is_partial() and p.is_replicate() for g, p in zip(grad.placements, spec.placements)]
        if any(partial):
            if _partial_grads:
                _partial_grads[-1].add(ctx.fqn)
            kept = tuple(g if is_partial else p for g, p, is_partial in zip(grad.placements, spec.placements, partial))
            return grad.redistribute(spec.mesh, kept).to_local(), None, None
        return grad.redistribute(spec.mesh, spec.placements).to_local(), None, None


@contextlib.contextmanager
def recording_partial_grads() -> Iterator[set[str]]:
    """While active, the parameters whose local gradient a traced backward leaves as a partial
    sum over "tp" are added to the set it yields."""
    found: set[str] = set()
    _partial_grads.append(found)
    try:
        yield found
    finally:
        _partial_grads.pop()


def _run_lowered(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return _CALLS[key].run(tensors)


def is_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is CALL_OP


def call_of(node: fx.Node) -> ParallelCall:
    return _CALLS[node.args[1]]


def has_calls(graph_module: fx.GraphModule) -> bool:
    return any(is_call(n) for n in graph_module.graph.nodes)


def lowered(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of `graph_module` whose tensor-parallel calls run their modules on DTensors
    (traced, they become local ops and collectives); `graph_module` itself if it has none."""
    if not has_calls(graph_module):
        return graph_module
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    for node in graph.nodes:
        if is_call(node):
            node.target = _run_lowered
    return fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)


class _StandIn(nn.Module):
    """Takes the place of a tensor-parallel module while the model is traced: each call becomes
    one `tensor_parallel_call` node."""

    def __init__(self, calls: "ParallelCalls", fqn: str, original: nn.Module) -> None:
        super().__init__()
        self._zb = (calls, fqn, original)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls, fqn, original = self._zb
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        state = {**dict(original.named_parameters()), **dict(original.named_buffers())}
        call = calls.new_call(fqn, original, in_spec, leaves, tensors, state)
        with ti.annotate_nodes({"module": fqn}):
            outputs = torch.ops.zbcompile.tensor_parallel_call([*tensors, *state.values()], call.key)
        for output, spec in zip(outputs, call.output_specs):
            if spec is not None:
                calls.dtensor_outputs[output] = (spec, fqn)
        return call.rebuild(list(outputs))


@dataclass(eq=False)
class ParallelCalls:
    """The tensor-parallel calls of one trace (holding them keeps their `ParallelCall`s alive):
    `calls` in trace order; `specs`: the tp layout of each DTensor parameter and buffer, by
    canonical FQN, as the model held it when traced."""

    modules: dict[str, nn.Module]
    specs: dict[str, LocalSpec]
    canonical: dict[str, str]
    calls: list[ParallelCall] = field(default_factory=list)
    dtensor_outputs: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # -> (LocalSpec, FQN)

    @staticmethod
    def of(model: nn.Module) -> "ParallelCalls | None":
        """`model`'s tensor-parallel modules and DTensor layouts; None where it has none."""
        modules = parallel_modules(model)
        if not modules:
            return None
        canonical: dict[str, str] = {}
        for named in (model.named_parameters, model.named_buffers):
            first: dict[int, str] = {}
            for name, tensor in named(remove_duplicate=False):
                canonical[name] = first.setdefault(id(tensor), name)
        specs = {
            canonical[n]: LocalSpec.of(t)
            for n, t in [*model.named_parameters(), *model.named_buffers()]
            if is_tensor_parallel(t)
        }
        return ParallelCalls(modules, specs, canonical)

    @property
    def mesh(self) -> DeviceMesh | None:
        return next((s.mesh for s in self.specs.values()), None)

    def new_call(self, fqn, module, in_spec, leaves, tensors, state) -> ParallelCall:
        prefix = f"{fqn}." if fqn else ""
        fqns = tuple(self.canonical.get(prefix + n, prefix + n) for n in state)
        call = ParallelCall(
            key=f"{fqn}#{next(_CALL_NUMBERS)}",
            fqn=fqn,
            module=module,
            in_spec=in_spec,
            constants=tuple(None if isinstance(x, torch.Tensor) else x for x in leaves),
            input_specs=tuple(self.dtensor_outputs.get(t, (None,))[0] for t in tensors),
            state=tuple(state),
            state_fqns=fqns,
            state_specs=tuple(self.specs.get(f) for f in fqns),
        )
        self.calls.append(call)
        _CALLS[call.key] = call
        return call

    def refuse_dtensor_result(self, output: Any) -> None:
        """Refuse a model output holding a DTensor result of a tensor-parallel module (the loss
        would read a local shard where eager reads the DTensor, as under `loss_parallel`)."""
        for leaf in pytree.tree_leaves(output):
            found = self.dtensor_outputs.get(leaf) if isinstance(leaf, torch.Tensor) else None
            if found is not None:
                spec, fqn = found
                raise ValueError(
                    f"tensor parallelism: the model returns the DTensor result of module '{fqn}' "
                    f"({list(spec.placements)} over the '{TP}' mesh dimension); zbcompile computes the loss on whole "
                    "tensors (loss_parallel is not supported): give that module's ParallelStyle "
                    "output_layouts=Replicate() and use_local_output=True"
                )

    @contextlib.contextmanager
    def standing_in(self, model: nn.Module) -> Iterator[None]:
        """While active, every tensor-parallel module of `model` is replaced, where its parent
        registers it, by a stand-in recording its calls (the caller restores `_modules`)."""
        for fqn, module in self.modules.items():
            parent_name, _, leaf = fqn.rpartition(".")
            model.get_submodule(parent_name)._modules[leaf] = _StandIn(self, fqn, module)
        yield


def check_local_use(graph: fx.Graph) -> None:
    """Refuse a trace where a DTensor result of a tensor-parallel module is read by code outside
    the tensor-parallel modules (where eager would compute with a DTensor, the trace has its
    local shard)."""
    for node in graph.nodes:
        if not is_call(node):
            continue
        call = call_of(node)
        for user in node.users:
            index = user.args[1]
            spec = call.output_specs[index] if index < len(call.output_specs) else None
            readers = [u for u in user.users if not is_call(u) and u.op != "output"]
            if spec is not None and readers:
                module = readers[0].meta.get("custom", {}).get("module", "<root>")
                raise ValueError(
                    f"tensor parallelism: module '{call.fqn}' returns a DTensor ({list(spec.placements)} over the "
                    f"'{TP}' mesh dimension) that module '{module}' reads outside the tensor-parallel modules; "
                    "give the module's ParallelStyle use_local_output=True, or parallelize the module that reads it"
                )


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """What the stage programs compute with in place of `tensor`: a DTensor's local shard over
    "tp" and its whole over "dp" (shapes only, on `meta`, where it is not this rank's local
    tensor); any other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    names = tensor.device_mesh.mesh_dim_names or ()
    if names == (TP,):
        return tensor.to_local()
    shape = list(tensor.shape)
    if TP in names:
        spec = LocalSpec.of(tensor)
        rank, size = spec.mesh.get_local_rank(), spec.mesh.size()
        for placement in spec.placements:
            if placement.is_shard():
                pieces = torch.empty(shape, device="meta").chunk(size, placement.dim)
                shape[placement.dim] = pieces[rank].shape[placement.dim] if rank < len(pieces) else 0
    return torch.empty(shape, dtype=tensor.dtype, device="meta")
