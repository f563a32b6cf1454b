"""Pass 1: capture forward + loss of one microbatch as an aten-level, functional FX graph.

`trace_model(model, loss_fn, args, kwargs, target)` runs `loss_fn(model(*args, **kwargs), target)`
under `make_fx` with fake tensors and functionalization. The returned graph takes one placeholder
per parameter, buffer, tensor input and target tensor (see `TracedModel`) and returns the scalar
loss, then the new value of every buffer the forward updates (BatchNorm's running statistics in
training, a counter, an EMA). Every call_function node carries the FQN of the innermost module
that created it in `node.meta["custom"]["module"]`, which the partitioner uses for split points.
A failure in the user's code is reported by `trace_errors.py`, naming the module and source line.

Example (a two-layer MLP, loss = mse):

    placeholders: fc1.weight, fc1.bias, fc2.weight, fc2.bias (params), input_0 (input), target_0
    t = aten.t(fc1.weight)                       module: fc1
    addmm = aten.addmm(fc1.bias, input_0, t)     module: fc1
    relu = aten.relu(addmm)                      module: act
    ...
    mse_loss = aten.mse_loss(addmm_1, target_0)  module: ""
    return mse_loss
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from zbcompile import _torch_internals as ti
from zbcompile._torch_internals import FakeTensorMode, pytree
from zbcompile.passes import _fx, tensor_parallel
from zbcompile.passes.autograd_in_forward import detach_no_grad_results, watching_autograd
from zbcompile.passes.causal_mask import fold_causal_masks
from zbcompile.passes.loss_parts import ItemCount, OutputStructure, cut_out_count, sum_and_count
from zbcompile.passes.shape_symbols import NotGeneric, ShapeSymbols, introduce_size_placeholders, symbolic_tracing
from zbcompile.passes.trace_errors import NameStack, raised_here, traced_error

# meta["zb_role"] of placeholders (what the placeholder is; not the value names of value_names.py)
ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT, ROLE_TARGET = "param", "buffer", "input", "target"


@dataclass(frozen=True)
class TracedModel:
    """The forward + loss graph of one microbatch.

    graph_module: placeholders, in order: parameters, buffers, tensor inputs, target tensors.
        Each placeholder has `meta["zb_role"]` (ROLE_PARAM, ROLE_BUFFER, ROLE_INPUT or ROLE_TARGET) and
        `meta["zb_name"]` (the FQN for parameters and buffers; "input_<i>"/"target_<i>" for the
        tensor leaves of (args, kwargs) and of the target, in pytree order). Outputs: the loss,
        then the new value of each buffer in `buffer_updates`.
    param_fqns / buffer_fqns: the model's parameters and buffers (tied weights once, under the
        name `named_parameters()` reports).
    model: the traced module (its parameters may live on the `meta` device).
    fake_mode / fake_state: the fake-tensor mode the graphs were traced in, and a fake tensor for
        every parameter and buffer FQN (on the device the pipeline runs on); later passes trace
        stages against these, so compiling never needs real weights.
    input_spec: pytree spec of (args, kwargs); `constants` holds its non-tensor leaves (None where
        a tensor goes), which the graph has baked in.
    target_spec: pytree spec of the target (None when there is no loss_fn or no target).
    buffer_updates: FQNs of the buffers the forward updates in place, in the order of their new
        values among the graph's outputs. The runtime writes each new value into its buffer after
        the forward of every microbatch, as an eager run microbatch by microbatch would.
    count: a `(loss_sum, count)` loss's count (`loss_parts.ItemCount`; the loss output is then
        loss_sum); None for a loss that is a microbatch's mean.
    results: how many outputs come before the buffers' new values: 1 (the loss), or with
        `outputs` the model output's tensor leaves, which `output_structure` puts together.
    """

    graph_module: fx.GraphModule
    model: nn.Module
    fake_mode: FakeTensorMode
    fake_state: dict[str, torch.Tensor]
    param_fqns: tuple[str, ...]
    buffer_fqns: tuple[str, ...]
    input_spec: pytree.TreeSpec
    constants: tuple[Any, ...]
    target_spec: pytree.TreeSpec | None
    buffer_updates: tuple[str, ...] = ()
    count: ItemCount | None = None
    results: int = 1
    output_structure: OutputStructure | None = None
    parallel: tensor_parallel.ParallelCalls | None = None  # the tensor-parallel modules' calls
    symbols: ShapeSymbols | None = None  # a trace with symbolic dimensions: its sizes' placeholders

    def placeholders(self, role: str) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.find_nodes(op="placeholder") if n.meta["zb_role"] == role]


def trace_model(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, args: tuple, kwargs: dict[str, Any],
    target: Any = None, device: torch.device | None = None, record_stack_traces: bool = True, outputs: bool = False,
    dynamic: Mapping[str, Sequence[int]] | None = None,
) -> TracedModel:
    """Trace `loss_fn(model(*args, **kwargs), target)` (or `model(...)` itself when loss_fn is None,
    which must then return the loss, see `_loss_of_output`; `loss_fn` may return `(loss_sum,
    count)`, see `loss_parts`), or with `outputs` the model's output (its tensor leaves; no loss),
    with `torch.compiler`'s compiling flag set, as torch.compile traces
    (`_torch_internals.traced_like_compile`). `model` is left as it was. Raises ValueError naming
    the module and the source line for data-dependent control flow, and naming the parameter or
    input for a forward that writes one in place (buffer updates become graph outputs, see
    `TracedModel`); any other error is re-raised naming the module (or loss_fn) and the source line.
    Parameters (and inputs) on the `meta` device trace as if they lived on `device` (default: the
    inputs' device). `record_stack_traces=False` skips recording each node's source line (a third of
    the trace's time; later errors then name the module only)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    input_leaves, input_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    input_tensors = [x for x in input_leaves if isinstance(x, torch.Tensor)]
    constants = tuple(None if isinstance(x, torch.Tensor) else x for x in input_leaves)
    with_target = loss_fn is not None and target is not None and not outputs
    target_leaves, target_spec = pytree.tree_flatten(target) if with_target else ([], None)
    if any(not isinstance(t, torch.Tensor) for t in target_leaves):
        raise TypeError("target must be a tensor or a pytree (tuple/list/dict) of tensors")

    def forward_and_loss(param_values, buffer_values, tensors, targets):
        tensor_iter = iter(tensors)
        leaves = [next(tensor_iter) if c is None else c for c in constants]
        call_args, call_kwargs = pytree.tree_unflatten(leaves, input_spec)
        state = {**dict(zip(params, param_values)), **dict(zip(buffers, buffer_values))}
        target_value = pytree.tree_unflatten(list(targets), target_spec) if target_spec is not None else None
        with watching_autograd(module_stack.current), _substituted(model, state), standing_in(model):
            output = model(*call_args, **call_kwargs)
            if parallel is not None:
                parallel.refuse_dtensor_result(output)
            if outputs:
                structure[0], tensors = OutputStructure.of(output)
                return tuple(tensors)
            module_stack.in_loss_fn = True
            loss = _loss_of_output(output) if loss_fn is None else loss_fn(output, target_value)
        loss, count[0] = sum_and_count(loss) if loss_fn is not None else (loss, None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            what = "the model" if loss_fn is None else "loss_fn"
            raise TypeError(f"{what} must return a scalar floating-point loss tensor; got {_describe(loss)}")
        return (loss, count[0]) if isinstance(count[0], torch.Tensor) else loss

    structure: list[OutputStructure | None] = [None]  # what the traced function saw, for afterwards
    count: list[Any] = [None]

    tensors = [*input_tensors, *target_leaves]
    device = device or (tensors[0].device if tensors else torch.device("cpu"))
    fake_mode = ti.symbolic_fake_mode() if dynamic else ti.FakeTensorMode()
    fake_state = {name: _fake_local(fake_mode, value, device) for name, value in [*params.items(), *buffers.items()]}

    def fake_input(tensor: torch.Tensor, name: str) -> torch.Tensor:
        if dynamic and dynamic.get(name):
            return ti.fake_with_symbolic_dims(fake_mode, tensor, tuple(dynamic[name]), name, device)
        return ti.fake_contiguous(fake_mode, tensor, device)  # meta inputs: on `device` too

    parallel = tensor_parallel.ParallelCalls.of(model)
    standing_in = parallel.standing_in if parallel is not None else lambda model: contextlib.nullcontext()
    # Fresh contiguous fakes (the runtime feeds contiguous microbatches), so that an input passed
    # twice (an autoencoder's input and target) traces as two distinct graph inputs.
    example = (
        [fake_state[n] for n in params],
        [fake_state[n] for n in buffers],
        [fake_input(t, f"input_{i}") for i, t in enumerate(input_tensors)],
        [fake_input(t, f"target_{i}") for i, t in enumerate(target_leaves)],
    )
    # Traced as torch.compile traces: libraries that ask whether they are being compiled
    # (transformers' masks) take their traceable path.
    with (
        ti.traced_like_compile(),
        ti.preserve_node_meta(),
        _module_annotations(model) as module_stack,
        _checkpoint_annotations(module_stack),
        symbolic_tracing() if dynamic else contextlib.nullcontext(),
    ):
        try:
            with fake_mode, ti.onednn_disabled():
                graph_module = ti.make_fx(
                    torch.func.functionalize(forward_and_loss, remove="mutations"),
                    record_stack_traces=record_stack_traces,
                )(*example)
        except Exception as error:  # noqa: BLE001 - re-raised, naming where tracing stopped
            if raised_here(error):
                raise
            raise traced_error(module_stack, error) from error

    roles = (
        [(ROLE_PARAM, fqn) for fqn in params]
        + [(ROLE_BUFFER, fqn) for fqn in buffers]
        + [(ROLE_INPUT, f"input_{i}") for i in range(len(input_tensors))]
        + [(ROLE_TARGET, f"target_{i}") for i in range(len(target_leaves))]
    )
    placeholders = list(graph_module.graph.find_nodes(op="placeholder"))
    for node, (role, name) in zip(placeholders, roles, strict=True):
        node.meta["zb_role"], node.meta["zb_name"] = role, name
    symbols = introduce_size_placeholders(graph_module.graph, fake_mode) if dynamic else None
    if symbols is not None and not symbols.names:
        raise NotGeneric(f"the trace fixes {symbols.describe()} (guards {', '.join(map(str, symbols.guards()[:3]))})")
    roles = {n: n.meta["zb_role"] for n in graph_module.graph.find_nodes(op="placeholder")}
    item_count = None if count[0] is None else cut_out_count(graph_module, count[0], roles)
    results = len(graph_module.graph.output_node().args[0]) if outputs else 1
    if parallel is not None:
        tensor_parallel.check_local_use(graph_module.graph)
    buffer_updates = _buffer_updates_as_outputs(graph_module.graph, fake_mode)
    detach_no_grad_results(graph_module.graph)
    _differentiable_copies(graph_module.graph, fake_mode)
    fold_causal_masks(graph_module.graph, fake_mode)
    graph_module.graph.eliminate_dead_code()  # autograd's unused `detach`es of saved values, folded masks
    graph_module = ti.use_plain_codegen(graph_module)  # make_fx flattens inputs with pytree
    return TracedModel(
        graph_module=graph_module, model=model, fake_mode=fake_mode, fake_state=fake_state, param_fqns=tuple(params),
        buffer_fqns=tuple(buffers), input_spec=input_spec, constants=constants, target_spec=target_spec,
        buffer_updates=buffer_updates, count=item_count, results=results, output_structure=structure[0],
        parallel=parallel, symbols=symbols,
    )


def _fake_local(mode: FakeTensorMode, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake of what the stages compute with in place of parameter or buffer `value`
    (`tensor_parallel.local_view`: a DTensor's local shard over "tp"), a parameter if it is one."""
    fake = ti.fake_like(mode, tensor_parallel.local_view(value), device)
    if isinstance(value, nn.Parameter) and not isinstance(fake, nn.Parameter):
        fake = nn.Parameter(fake, value.requires_grad)
    return fake


def _differentiable_copies(graph: fx.Graph, fake_mode: FakeTensorMode) -> None:
    """Functionalization turns `h[:, :2] = v` into `slice_scatter(h, copy(h[:, :2], v), ...)`;
    autograd has no formula for the functional `aten.copy`, so the stages' joint graphs could not
    be traced through it. Its value is `v` converted to the destination's dtype and device and
    broadcast to its shape: built from differentiable ops instead."""
    aten = torch.ops.aten
    for node in list(graph.find_nodes(op="call_function", target=aten.copy.default)):
        destination, source = node.args[0], node.args[1]
        want = destination.meta["val"]

        def apply(op, value: fx.Node, *args: Any, **kwargs: Any) -> fx.Node:
            with graph.inserting_before(node):
                result = graph.call_function(op, (value, *args), kwargs)
            with fake_mode:
                result.meta = {**node.meta, "val": op(value.meta["val"], *args, **kwargs)}
            return result

        value = source
        if (source.meta["val"].dtype, source.meta["val"].device) != (want.dtype, want.device):
            value = apply(aten._to_copy.default, value, dtype=want.dtype, device=want.device)
        if tuple(value.meta["val"].shape) != tuple(want.shape):
            value = apply(aten.expand.default, value, list(want.shape))
        if value.target is not aten._to_copy.default:  # a new tensor, as copy's result is
            value = apply(aten.clone.default, value)
        node.replace_all_uses_with(value)
        graph.erase_node(node)


# node.meta["custom"][CHECKPOINT]: the index of the `torch.utils.checkpoint` region that
# computed the node (its values are recomputed for the backward instead of saved; see joint.py)
CHECKPOINT = "checkpoint"


def _checkpoint_annotations(module_stack: "NameStack") -> contextlib.AbstractContextManager:
    """Tag the nodes traced inside each non-reentrant `torch.utils.checkpoint` region; refuse a
    reentrant one (a custom autograd.Function), naming the module that called it."""

    def refuse() -> None:
        raise ValueError(
            f"{module_stack.where()} calls torch.utils.checkpoint with use_reentrant=True, whose custom "
            "autograd.Function zbcompile cannot trace; pass use_reentrant=False (zbcompile recomputes the region "
            "in the backward)"
        )

    return ti.annotated_checkpoints(lambda region: ti.annotate_nodes({CHECKPOINT: region}), refuse)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def _module_annotations(model: nn.Module):
    """Annotate every traced node with the FQN of the innermost module running; yields the live
    stack of module FQNs (so an error can say where tracing stopped)."""
    stack: list[tuple[str, contextlib.AbstractContextManager, nn.Module]] = []

    def enter(name, module, args):
        context = ti.annotate_nodes({"module": name})
        context.__enter__()
        stack.append((name, context, module))

    def leave(name, module, args, output):
        if stack and stack[-1][0] == name:
            stack.pop()[1].__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(functools.partial(enter, name)))
            handles.append(module.register_forward_hook(functools.partial(leave, name)))
    names = NameStack(stack, model)
    try:
        yield names
    finally:
        for handle in handles:
            handle.remove()
        while stack:
            stack.pop()[1].__exit__(None, None, None)


@contextlib.contextmanager
def _substituted(model: nn.Module, values: dict[str, torch.Tensor]):
    """Run with `values[fqn]` in place of every parameter and buffer (by the FQN `named_parameters()`
    and `named_buffers()` report), wherever the tensor is registered: a weight tied between modules
    and a module registered under two names (`self.b = self.a`) are substituted once per slot.
    Afterwards every module is restored exactly, whatever the forward did or raised: parameters,
    buffers, submodules and attributes are the objects they were."""
    canonical = {id(t): name for named in (model.named_parameters, model.named_buffers) for name, t in named()}
    modules = list(model.modules())  # each module once, however many names it has
    saved = [
        (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules),
         set(m._non_persistent_buffers_set))
        for m in modules
    ]
    try:
        for module in modules:
            for slots in (module._parameters, module._buffers):
                for leaf, tensor in slots.items():
                    if tensor is not None and id(tensor) in canonical:
                        slots[leaf] = values[canonical[id(tensor)]]
        yield
    finally:
        for module, attributes, parameters, buffers, submodules, non_persistent in saved:
            for name in [n for n in module.__dict__ if n not in attributes]:
                del module.__dict__[name]
            module.__dict__.update(attributes)
            slots = ((module._parameters, parameters), (module._buffers, buffers), (module._modules, submodules))
            for current, before in slots:
                current.clear()
                current.update(before)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)


def _loss_of_output(output: Any) -> Any:
    """The loss of a model that computes its own: the output itself (a scalar tensor), its `loss`
    entry (a mapping such as transformers' ModelOutput) or attribute (a dataclass), or the first
    element of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "loss" in output:
            return output["loss"]
    elif hasattr(output, "loss"):
        return output.loss
    elif isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(
        f"without a loss_fn the model must return its loss: a scalar tensor, an output with a 'loss' entry or "
        f"attribute, or a tuple whose first element is the loss; it returned {_describe(output)}"
        f"{_keys_of(output)}. Pass the labels it computes the loss from, or give pipeline() a loss_fn"
    )


def _keys_of(output: Any) -> str:
    return f" with entries {list(output)[:8]}" if isinstance(output, Mapping) else ""


# Batch norms whose schema hides that they update `running_mean` and `running_var` (arguments 3
# and 4) in training, so functionalization keeps them as they are. They share their first eight
# arguments and their first three results (output, saved mean, saved inverse std) with
# `_native_batch_norm_legit_functional`, which returns the new statistics as results 3 and 4.
_HIDDEN_UPDATE_BATCH_NORMS = (
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.cudnn_batch_norm.default,
    torch.ops.aten.miopen_batch_norm.default,
)


def _buffer_updates_as_outputs(graph: fx.Graph, fake_mode: FakeTensorMode) -> tuple[str, ...]:
    """Turn every in-place update of a buffer into a graph output, the buffer's new value,
    appended after the loss; returns the buffers' FQNs in that order. After functionalization
    an update of a graph input survives only as `copy_(placeholder, new value)` (or as a batch
    norm that hides its update, made functional first). Raises ValueError naming the module for
    a forward that writes a parameter, an input or a target in place."""
    _functional_batch_norms(graph, fake_mode)
    new_values: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        for _, value in _fx.written_arguments(node):
            if not (isinstance(value, fx.Node) and value.op == "placeholder"):
                continue
            if node.target is not torch.ops.aten.copy_.default or value.meta["zb_role"] != ROLE_BUFFER:
                raise ValueError(_mutation_message(value, node))
            new_values[value.meta["zb_name"]] = node.args[1]
            graph.erase_node(node)
    roots = _fx.storage_roots(graph)
    for fqn, value in new_values.items():
        if roots[value].op == "placeholder":  # a graph input (or a view of one) copied as it is
            with graph.inserting_before(graph.output_node()):
                new_values[fqn] = graph.call_function(torch.ops.aten.clone.default, (value,))
            new_values[fqn].meta = {k: v for k, v in value.meta.items() if not k.startswith("zb_")}
    output = graph.output_node()
    output.args = ([*output.args[0], *new_values.values()],)
    return tuple(new_values)


def _functional_batch_norms(graph: fx.Graph, fake_mode: FakeTensorMode) -> None:
    """Replace each batch norm in training that updates running statistics held in placeholders
    (`_HIDDEN_UPDATE_BATCH_NORMS`) by `_native_batch_norm_legit_functional` (the same kernel):
    whatever reads a statistic after it reads its new value, and `copy_`s at the end of the graph
    write the last values into the placeholders, as functionalization writes back any update."""
    functional = torch.ops.aten._native_batch_norm_legit_functional.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    latest = {n: n for n in graph.find_nodes(op="placeholder")}  # a placeholder's current value
    origin = {n: n for n in latest}  # current value -> its placeholder
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _HIDDEN_UPDATE_BATCH_NORMS]:
        statistics = node.args[3:5]
        if not node.args[5] or not all(s in origin for s in statistics):
            continue  # args[5]: training
        args = node.args[:8]
        with graph.inserting_before(node):
            replacement = graph.call_function(functional, args)
        with fake_mode:
            value = functional(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        replacement.meta = {**node.meta, "val": value}
        for user in list(node.users):
            if user.args[1] >= 3:  # cudnn's reserve space, which only its backward reads
                raise ValueError(
                    f"the forward reads result {user.args[1]} of {node.target}, which zbcompile cannot trace"
                )
            user.args = (replacement, user.args[1])
        previous = replacement
        for statistic, index in zip(statistics, (3, 4)):
            with graph.inserting_after(previous):
                new = previous = graph.call_function(operator.getitem, (replacement, index))
            new.meta = {**node.meta, "val": replacement.meta["val"][index]}
            for reader in [u for u in statistic.users if order.get(u, -1) > order[node]]:
                reader.replace_input_with(statistic, new)
            origin[new] = origin[statistic]
            latest[origin[new]] = new
        graph.erase_node(node)
    for placeholder, value in latest.items():
        if value is not placeholder:
            with graph.inserting_before(graph.output_node()):
                graph.call_function(torch.ops.aten.copy_.default, (placeholder, value))


def _mutation_message(placeholder: fx.Node, node: fx.Node) -> str:
    role, name = placeholder.meta["zb_role"], placeholder.meta["zb_name"]
    module = node.meta.get("custom", {}).get("module")
    if module is None:  # functionalization's write-back runs after the forward: name the owner
        module = name.rpartition(".")[0] if role in (ROLE_PARAM, ROLE_BUFFER) and "." in name else "<root>"
    what, remedy = role, (
        "The stages compute with copies of the inputs; return the new value instead of writing it in place."
    )
    if role == ROLE_PARAM:
        what, remedy = "parameter", (
            "Parameters change only in the optimizer's step; keep state that the forward updates in a "
            "buffer (register_buffer), whose updates zbcompile applies microbatch by microbatch."
        )
    return f"the forward of module '{module}' mutates {what} '{name}' in place ({node.target}). {remedy}"
