"""The one place that reaches into private torch APIs (AOTAutograd, FX tracing meta, FLOP
formulas). A torch upgrade that moves them touches this file only."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.fx.traceback as fx_traceback
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import default_partition
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._sympy.functions import FloorDiv

# What tracing with fake tensors raises when Python control flow depends on tensor values.
DATA_DEPENDENT_ERRORS = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)

__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "FloorDiv",
    "FakeTensorMode",
    "OpOverload",
    "TENSOR_DATA",
    "TENSOR_REQUIRES_GRAD",
    "pytree",
    "use_plain_codegen",
    "graph_module_coded_on_use",
    "boxed_copy",
    "TorchDispatchMode",
    "BufferAOTInput",
    "GradAOTOutput",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "TangentAOTInput",
    "annotate_nodes",
    "aot_autograd",
    "default_partition",
    "graph_break",
    "inductor_compile",
    "traced",
    "dispatch_mode_active",
    "default_store",
    "register_dynamo_backend",
    "export_joint",
    "fake_contiguous",
    "fake_like",
    "fake_strided",
    "version_of",
    "requires_grad_unwrapped",
    "count_flops",
    "strided_shard",
    "LocalFlopCounter",
    "has_flop_formula",
    "make_fx",
    "preserve_node_meta",
    "quiet_torch_logs",
    "traced_like_compile",
    "symbolic_fake_mode",
    "fake_with_symbolic_dims",
    "python_dispatcher",
]

aten = torch.ops.aten

preserve_node_meta = fx_traceback.preserve_node_meta

# The C descriptors behind `Tensor.data` and `Tensor.requires_grad` (their getters and setters).
TENSOR_DATA = torch._C.TensorBase.__dict__["data"]
TENSOR_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]


def use_plain_codegen(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph_module` with the plain code generator (flat positional placeholders) in place of
    make_fx's pytree flattening of inputs; its code is generated when first run or read."""
    graph_module.graph._codegen = torch.fx.graph.CodeGen()
    return _LazyGraphModule.from_graphmodule(graph_module)


def graph_module_coded_on_use(root: torch.nn.Module | dict, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A GraphModule of `graph` whose Python code is generated when it is first run or its code
    read (torch.fx's lazy GraphModule): for graphs that later passes read but may never run."""
    return _LazyGraphModule(root, graph, class_name=name)


def boxed_copy(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule computing what `graph_module` computes, called with one list of its inputs
    that it empties first (torch.fx's boxed calling convention, as AOTAutograd's compiled
    graphs): the list is then the only holder of the inputs the caller handed over, and the
    generated code drops each input after its last use. Run under no_grad (`Program.run`), it
    runs fewer ops and calls each one directly (`_drop_detaches`, `_call_ops_directly`)."""
    from torch.fx.graph import _BoxedCodeGen

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    _drop_detaches(graph)
    graph.set_codegen(_BoxedCodeGen())
    boxed = torch.fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__)
    boxed.recompile()
    _call_ops_directly(boxed)
    return boxed


def _drop_detaches(graph: torch.fx.Graph) -> None:
    """Remove the `detach` ops whose result the graph does not return: the graphs run under
    no_grad, where a detach computes nothing (it makes another tensor object of the same
    storage), and a graph run op by op pays each op's dispatch."""
    detach = torch.ops.aten.detach.default
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is detach and all(u.op != "output" for u in node.users):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


class _Names:
    """Attributes given, the rest those of `fallback` (kept once looked up)."""

    def __init__(self, fallback: Any, names: dict[str, Any]) -> None:
        self.__dict__.update(names)
        self._fallback = fallback

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._fallback, name)
        setattr(self, name, value)
        return value


def _call_ops_directly(graph_module: torch.fx.GraphModule) -> None:
    """Make `graph_module`'s generated code call each operator's entry point (`OpOverload._op`,
    all that `OpOverload.__call__` does) without the Python frame of `__call__`: a graph run op
    by op spends about 0.5-1 us of a small op's 2-5 us there. The code names an operator
    `torch.ops.NS.OP.OVERLOAD` (torch.fx's qualified name); its global `torch` becomes a
    namespace answering those with the entry points and every other name from torch."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            op = node.target
            found.setdefault(op.namespace, {}).setdefault(op._opname, {})[op._overloadname] = op._op
    namespaces = {}
    for namespace, packets in found.items():
        real = getattr(torch.ops, namespace)
        namespaces[namespace] = _Names(real, {n: _Names(getattr(real, n), o) for n, o in packets.items()})
    code_globals = type(graph_module).forward.__globals__
    if code_globals.get("torch") is torch:
        code_globals["torch"] = _Names(torch, {"ops": _Names(torch.ops, namespaces)})


def failing_node(graph_module: torch.fx.GraphModule, error: BaseException) -> torch.fx.Node | None:
    """The node of `graph_module` whose line of the generated code was running when `error` was
    raised (through the code's line-to-node map, as torch.fx's own error message finds the line),
    or None when the error did not pass through that code."""
    code = type(graph_module).forward.__code__
    line_to_node = getattr(graph_module, "_lineno_map", None) or {}
    frame = error.__traceback__
    while frame is not None and frame.tb_frame.f_code is not code:
        frame = frame.tb_next
    if frame is None:
        return None
    index = line_to_node.get(frame.tb_lineno - getattr(graph_module, "_prologue_start", 0))
    return None if index is None else list(graph_module.graph.nodes)[index]


@contextlib.contextmanager
def traced_like_compile() -> Iterator[None]:
    """While active, `torch.compiler.is_compiling()` answers True and `is_exporting()` False, as
    while torch.compile traces: library code that asks whether it is being traced takes its
    traceable path (transformers' attention masks, its mixture-of-experts kernels), and code that
    decides by structure alone keeps its fast path, as a compiled model's does (no attention mask
    given: `is_causal=True` instead of a materialised causal mask, half the attention's work on a
    GPU). Under `is_exporting()` libraries must trace for every mask, so they build one."""
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


DEBUG_ENV = "ZBCOMPILE_DEBUG"


@contextlib.contextmanager
def quiet_torch_logs(warnings_too: bool = False):
    """Silence torch's own loggers (the tracebacks fake-tensor kernels log before the error we
    report) and, with `warnings_too`, the warnings torch's modules issue, unless
    `ZBCOMPILE_DEBUG=1`. Loggers a user set to a level of their own (TORCH_LOGS) keep it."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        yield
        return
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            if warnings_too:
                warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            yield
    finally:
        logger.setLevel(level)


def annotate_nodes(annotation: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Nodes traced inside this context carry `annotation` in `node.meta["custom"]`."""
    return fx_traceback.annotate(annotation)


@contextlib.contextmanager
def annotated_checkpoints(
    annotate: Callable[[int], contextlib.AbstractContextManager], refuse_reentrant: Callable[[], None]
):
    """While active, every non-reentrant `torch.utils.checkpoint.checkpoint` call runs its
    function directly inside `annotate(region)` (region: 0, 1, 2, ... in call order) instead of
    installing checkpoint's saved-tensor hooks, so that a trace sees the region's ops, tagged;
    a reentrant one calls `refuse_reentrant()` (which raises). However the user imported
    `checkpoint`, it reaches these module-level names of torch.utils.checkpoint at call time."""
    import torch.utils.checkpoint as checkpoint_module

    originals = checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction
    regions = itertools.count()

    def generator(*args, **kwargs):
        with annotate(next(regions)):
            yield

    class Reentrant:
        @staticmethod
        def apply(*args, **kwargs):
            refuse_reentrant()

    checkpoint_module._checkpoint_without_reentrant_generator = generator
    checkpoint_module.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction = originals


def export_joint(module: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    """AOTAutograd joint forward+backward graph of `module(*args)`; placeholders and the output
    carry descriptors in `meta["desc"]` (see torch/_functorch/_aot_autograd/descriptors.py)."""
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, module, args)
        return joint.graph_module


def fake_like(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor in `mode` standing for `tensor`; a `meta` tensor becomes one on `device`."""
    if tensor.is_meta:
        fake = mode.fake_tensor_converter.from_meta_and_device(mode, tensor, device)
    else:
        fake = mode.from_tensor(tensor, static_shapes=True)
    return torch.nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else fake


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter: every in-place write to it increments it."""
    return tensor._version


def fake_contiguous(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A new contiguous fake tensor in `mode` with `tensor`'s shape, dtype and device (a `meta`
    tensor's on `device`, where given)."""
    with mode:
        where = device if tensor.is_meta and device is not None else tensor.device
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=where)


def fake_strided(mode: FakeTensorMode, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with mode:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def requires_grad_unwrapped(tensor: torch.Tensor) -> bool:
    """Whether autograd records `tensor`, looking through functorch wrappers (inside
    `torch.func.functionalize` the wrapper never requires grad; the tensor it wraps does)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor.requires_grad


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# torch ships no formula for the CPU flash-attention kernels; they count like the GPU ones.
_EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.shape_wrapper(_cpu_sdpa_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.shape_wrapper(
        _cpu_sdpa_backward_flop
    ),
}


def has_flop_formula(target: Any) -> bool:
    packet = getattr(target, "overloadpacket", target)
    return packet in flop_counter.flop_registry or packet in _EXTRA_FLOP_FORMULAS


def count_flops(target: Any, args: tuple, kwargs: dict, out: Any, symbolic: bool = False) -> Any:
    """FLOPs of one call of an aten overload, with (fake) tensors as arguments; 0 for ops that
    have no formula in `torch.utils.flop_counter` (elementwise ops, views). Of symbolic sizes:
    the count at the example traced, or with `symbolic` its sympy expression."""
    packet = getattr(target, "overloadpacket", target)
    formula = flop_counter.flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    flops = formula(*args, out_val=out, **kwargs) if formula else 0
    if isinstance(flops, torch.SymInt):
        return flops.node.expr if symbolic else int(flops.node.hint)
    return int(flops)


class LocalFlopCounter(TorchDispatchMode):
    """While active, counts in `flops` the FLOPs of the ops run on plain tensors off the `meta`
    device: of a DTensor computation, its local ops, each once (the op on DTensors is left to
    DTensor, whose shape propagation on `meta` is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if has_flop_formula(func) and not any(t.is_meta for t in tensors):
            self.flops += count_flops(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def onednn_disabled():
    """oneDNN off while tracing: its fused RNN layer (`mkldnn_rnn_layer`) returns a workspace its
    backward needs but that is absent at run time (pytorch#158007); without oneDNN, RNNs trace to
    ordinary aten ops. Ops that pick oneDNN when they run (convolution) are unaffected."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def aot_autograd(**kwargs: Any) -> Callable:
    """A Dynamo backend from AOTAutograd compilers (`fw_compiler`, `bw_compiler`,
    `partition_fn`); see torch/_dynamo/backends/common.py."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def register_dynamo_backend(name: str, compiler_fn: Callable) -> None:
    """Make `torch.compile(backend=name)` find `compiler_fn`. Does nothing when the name is
    registered already, or when torch has discovered it as a `torch_dynamo_backends` entry
    point that it has yet to load (torch registers the loaded function itself then)."""
    from torch._dynamo.backends import registry

    if name in registry._COMPILER_FNS or registry._BACKENDS.get(name) is not None:
        return
    registry.register_backend(compiler_fn, name=name)


def graph_break() -> None:
    """Ends the region Dynamo is compiling here (a graph break), as user code may."""
    import torch._dynamo

    torch._dynamo.graph_break()


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
    """`gm` (an aten-level graph returning a tuple) compiled by Inductor for inputs like
    `example_inputs` (their shapes, strides, dtypes and devices)."""
    import torch._inductor
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):  # no worker pool to start per process
        return torch._inductor.compile(gm, example_inputs)


def dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode sees each op now (a memory tracker, fake tensors)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def traced(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable | None:
    """`gm`'s ops recorded by TorchScript's tracer on `example_inputs` (run once, under no_grad,
    the CPU's and the inputs' devices' RNG states put back after), or None where `gm` calls
    other than aten ops (a collective would run once more than its peers' on this rank), takes
    other than plain tensors (a DTensor), or the tracer refuses it. `torch.jit.trace` warns
    that it is deprecated (torch.compile and torch.export are its successors: neither runs a
    graph's aten ops as they are from C++ without a compiler); the warning is silenced here, and
    a torch without it leaves graphs op by op."""
    aten = all(
        isinstance(n.target, OpOverload) and n.target.namespace == "aten" or n.target.__module__ == "_operator"
        for n in gm.graph.nodes
        if n.op == "call_function"
    )
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in example_inputs)  # no DTensor, no subclass
    if not aten or not plain or not hasattr(torch.jit, "trace"):
        return None
    devices = sorted({t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda}, key=str)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=devices), torch.no_grad():
            warnings.filterwarnings("ignore", message=".*torch.jit.* is deprecated", category=DeprecationWarning)
            return torch.jit.trace(lambda *inputs: gm(*inputs), tuple(example_inputs), check_trace=False)
    except Exception:  # noqa: BLE001 - whatever the tracer refuses runs op by op
        return None


def strided_shard(dim: int, split_factor: int):
    """DTensor's placement for a shard of a shard: dimension `dim` cut into `split_factor` pieces
    first (by a later mesh dimension), each piece then cut over this one (`_StridedShard`, as
    FSDP2 shards a tensor-parallel parameter's local rows)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def default_store():
    """The key-value store the default process group was made with (torch.distributed's)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


# --- symbolic sizes (one compile for every length) ----------------------------------------------
def symbolic_fake_mode() -> FakeTensorMode:
    """A fake-tensor mode with a ShapeEnv: dimensions made symbolic in it trace as symbols, and
    every guard the trace puts on them is recorded (`shape_symbols.ShapeSymbols.guards`). Equal sizes are not taken
    for one symbol (no duck sizing): only the trace's own guards tie two dimensions."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))


def fake_with_symbolic_dims(
    mode: FakeTensorMode, tensor: torch.Tensor, dims: Iterator[int] | tuple[int, ...], name: str,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A new contiguous fake of `tensor` (on `device` where `tensor` is on `meta`) in `mode` (a
    `symbolic_fake_mode`), its dimensions `dims` symbols (a size 0 or 1 stays a constant) named `name`."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    where = device if tensor.is_meta and device is not None else tensor.device
    sizes = [DimDynamic.DYNAMIC if d in set(dims) else DimDynamic.STATIC for d in range(tensor.dim())]
    example = torch.empty(tensor.shape, dtype=tensor.dtype, device=where)  # an input's size: small
    context = StatelessSymbolicContext(dynamic_sizes=sizes)
    return mode.from_tensor(example, symbolic_context=context, source=LocalSource(name))


def python_dispatcher() -> contextlib.AbstractContextManager:
    """Ops trace with their symbolic-size decompositions while active (as torch.compile traces)."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()
