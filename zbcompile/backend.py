"""The `torch.compile` backend "zbcompile": compiled regions whose backward splits into I (input
gradients) and W (weight gradients), so that any pipeline runtime can defer W.

    model = torch.compile(model, backend="zbcompile")
    loss = model(x).sum()
    with zbcompile.defer_weight_grads() as store:
        loss.backward()      # I: input gradients; parameter .grad untouched
        store.run()          # W, in order, into .grad

Each region is compiled by AOTAutograd; its forward runs as is. Its backward graph is split once
by the same graph-level pass as pipeline stages (`passes.split_backward.split_backward_program`).
Outside a `defer_weight_grads` block the region runs its unsplit backward, exactly what
AOTAutograd would. Inside one it runs I, returns the input gradients to autograd (None for each
parameter) and queues W with what W reads. The partition saves every trained parameter for the
backward, so that W accumulates into the parameters of the forward call it belongs to (one
compiled region may serve several module instances).

Importing this module registers the backend with Dynamo; the `torch_dynamo_backends` entry point
(pyproject.toml) makes torch find it without the import.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx, nn

from zbcompile import _torch_internals as ti
from zbcompile.passes import _fx
from zbcompile.passes.program import Program, Signature
from zbcompile.passes.split_backward import MIN_DEFERRAL_INTENSITY, IWPrograms, split_backward_program
from zbcompile.value_names import (
    fqn_of,
    grad_name,
    is_param_grad,
    param_grad_name,
    param_name,
    saved_name,
    tangent_name,
)
from zbcompile.weight_grads import WeightGradStore, active_store, defer_weight_grads, take_weight_grads

__all__ = ["WeightGradStore", "active_store", "defer_weight_grads", "take_weight_grads", "zbcompile_backend"]

BACKEND_NAME = "zbcompile"


def zbcompile_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """Dynamo backend: `torch.compile(model, backend="zbcompile")`. Dynamo passes the region's
    parameters among `example_inputs` (as the real `nn.Parameter`s)."""
    params = frozenset(i for i, x in enumerate(example_inputs) if isinstance(x, nn.Parameter) and x.requires_grad)
    region = _Region(params)
    backend = ti.aot_autograd(
        fw_compiler=_run_as_is, bw_compiler=region.compile_backward, partition_fn=region.partition
    )
    return backend(gm, example_inputs)


def _run_as_is(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    return _boxed(gm)


def _boxed(fn):
    """AOTAutograd's calling convention: one list argument."""

    def call(args: list) -> Any:
        return fn(*args)

    call._boxed_call = True
    return call


class _Region:
    """One compiled region. `params`: the positions of its trained parameters among its inputs."""

    def __init__(self, params: frozenset[int]) -> None:
        self.params = params

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        """AOTAutograd's default partition, plus every parameter saved for the backward."""
        forward, backward = ti.default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        _save_params(forward, backward, num_fwd_outputs, self.params)
        return forward, backward

    def compile_backward(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        named = _named_backward(gm, self.params)
        if named is None:  # a graph this backend cannot name: run it complete, always
            return _boxed(gm)
        program, output_names = named
        # cheap weight gradients stay in I by a cost estimate that needs concrete sizes; with
        # symbolic ones (Dynamo's automatic dynamic shapes) every weight gradient goes to W
        intensity = 0.0 if _has_symbolic_sizes(gm) else MIN_DEFERRAL_INTENSITY
        split = split_backward_program(program, intensity, class_prefix="Region")
        return _RegionBackward(gm, program.signature.inputs, output_names, split)


def _has_symbolic_sizes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape)
        ):
            return True
    return False


def _input_index(desc: object) -> int | None:
    return desc.idx if isinstance(desc, ti.PlainAOTInput) else None


def _save_params(
    forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, params: frozenset[int]
) -> None:
    """Make the parameters that the partition did not save saved tensors (first), so that the
    backward receives the very `nn.Parameter` objects of its forward call."""
    fw_output = forward.graph.output_node()
    outputs = list(fw_output.args[0])
    saved = set(outputs[num_fwd_outputs:])
    missing = [
        n for n in forward.graph.find_nodes(op="placeholder")
        if _input_index(n.meta.get("desc")) in params and n not in saved
    ]
    if not missing:
        return
    fw_output.args = ((*outputs[:num_fwd_outputs], *missing, *outputs[num_fwd_outputs:]),)
    # the backward reads the saved SymInts first, then the saved tensors, then the tangents
    first = next(
        (n for n in backward.graph.find_nodes(op="placeholder") if not isinstance(n.meta.get("val"), torch.SymInt)),
        None,
    )
    for node in missing:
        if first is not None:
            with backward.graph.inserting_before(first):
                copy = backward.graph.placeholder(node.name)
        else:
            copy = backward.graph.placeholder(node.name)
        copy.meta = dict(node.meta)
    forward.recompile()
    backward.recompile()


def _named_backward(gm: fx.GraphModule, params: frozenset[int]) -> tuple[Program, tuple[str | None, ...]] | None:
    """The backward as a Program in the split pass's naming (`param:<i>` for the parameter at
    input position i, `grad:param:<i>` its gradient, `grad:<i>` another input's gradient,
    `tangent:<k>`, `saved:<node>`), and the name of each output (None where it is None).
    None if the graph lacks the descriptors this needs."""
    inputs = []
    tangents = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if _input_index(desc) in params:
            inputs.append(param_name(desc.idx))
        elif isinstance(desc, ti.TangentAOTInput):
            inputs.append(tangent_name(tangents))
            tangents += 1
        else:
            inputs.append(saved_name(node.name))
    output_node = gm.graph.output_node()
    descs = output_node.meta.get("desc")
    returned = list(output_node.args[0])
    if descs is None or len(descs) != len(returned):
        return None
    output_names: list[str | None] = []
    for node, desc in zip(returned, descs):
        index = _input_index(getattr(desc, "grad_of", None)) if isinstance(desc, ti.GradAOTOutput) else None
        if node is None:
            output_names.append(None)
        elif index is None:
            return None
        else:
            output_names.append(param_grad_name(index) if index in params else grad_name(index))
    if any(param_name(fqn_of(name)) not in inputs for name in output_names if name and is_param_grad(name)):
        return None  # a parameter the partition did not hand to the backward
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    _fx.copy_nodes(graph, [n for n in gm.graph.nodes if n.op != "output"], env)
    graph.output(tuple(env[n] for n in returned if n is not None))
    program = Program(
        _fx.finish(graph, name="RegionBackward"), Signature(tuple(inputs), tuple(n for n in output_names if n))
    )
    return program, tuple(output_names)


class _RegionBackward:
    """The compiled backward of one region: unsplit outside `defer_weight_grads`, I plus a queued
    W inside it."""

    def __init__(
        self, unsplit: fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str | None],
        split: IWPrograms,
    ) -> None:
        self.unsplit = unsplit
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.split = split
        self.weight_grads = tuple(n for n in output_names if n and is_param_grad(n))
        self._boxed_call = True  # an instance attribute: torch's wrappers copy `__dict__`

    def __call__(self, args: list) -> list:
        store = active_store()
        if store is None or not self.weight_grads:
            return self.unsplit(*args)
        env = dict(zip(self.input_names, args))
        self.split.input_backward.run(env, {})
        store.put(_WeightWork(self.split, env, self.weight_grads))
        return [None if name is None or is_param_grad(name) else env[name] for name in self.output_names]


class _WeightWork:
    """One backward's W: the values it reads, the gradients I computed already (cheap ones), and
    the parameters the gradients belong to."""

    def __init__(self, split: IWPrograms, env: dict[str, Any], weight_grads: Sequence[str]) -> None:
        program = split.weight_backward
        self.program = program
        self.env = {n: env[n] for n in program.signature.inputs}
        self.ready = {param_grad_name(p): env[param_grad_name(p)] for p in split.input_param_grads}
        self.targets = {g: env[param_name(fqn_of(g))] for g in weight_grads}
        self.parameters = tuple(self.targets.values())

    def __call__(self) -> None:
        env, self.env = self.env, {}
        self.program.run(env, {})
        env.update(self.ready)
        for name, param in self.targets.items():
            _accumulate(param, env[name])
        self.ready, self.targets, self.parameters = {}, {}, ()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.grad` the way autograd does (in place when `.grad` exists; else a
    tensor of its own with the parameter's strides)."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)


ti.register_dynamo_backend(BACKEND_NAME, zbcompile_backend)
