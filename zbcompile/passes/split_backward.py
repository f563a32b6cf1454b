"""Pass 4: split a stage's backward into B (input gradients) and W (weight gradients).

B computes the gradients of the stage inputs, which the previous stage waits for, and the
`stash:` values W will need; W computes the parameter gradients from the stash, the saved
activations and the tangents. B is the backward restricted to the ancestors of the input
gradients; W is what the parameter gradients need on top of it. Fused backward ops that return
input and weight gradients at once (`native_layer_norm_backward`, `convolution_backward`,
`native_group_norm_backward`: any op with an `output_mask` argument) are cloned: B's copy asks
only for what B needs, W's copy for the rest. Parameter views are recomputed in each graph.
On the first stage no input needs a gradient, so B is empty and W holds the whole backward.

Example (one linear layer y = x @ w.T + b, gradient g of y):

    B: (param:w, tangent:y) -> (grad:x = g @ w,)          stash: none (W reads tangent:y directly)
    W: (in:x, tangent:y)    -> (grad:param:w = g.T @ x, grad:param:b = g.sum(0))
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

from torch import fx

from zbcompile.passes import _fx
from zbcompile.passes.joint import Program, StageJoint, extract_program


@dataclass(frozen=True)
class SplitBackward:
    """B and W of one stage. `stash` names what B computes for W; `weight_reads` every value W
    reads besides parameters (stash, saved activations, inputs, tangents); `freed_after_input`
    the saved values only B needed, dropped once B has run."""

    stage: int
    input_backward: Program
    weight_backward: Program
    stash: tuple[str, ...]
    weight_reads: tuple[str, ...]
    freed_after_input: tuple[str, ...]


def split_backward(joint: StageJoint) -> SplitBackward:
    backward = joint.backward
    graph = copy.deepcopy(backward.graph).graph  # the rewrite below must not touch the input
    placeholders = list(graph.find_nodes(op="placeholder"))
    names = dict(zip(placeholders, backward.signature.inputs))
    is_input_grad = [not v.startswith("grad:param:") for v in backward.signature.outputs]
    returned = graph.output_node().args[0]
    _split_fused_ops(graph, needed_by_input=_fx.ancestors([n for n, i in zip(returned, is_input_grad) if i]))
    outputs = list(zip(graph.output_node().args[0], backward.signature.outputs))
    input_grads = [(n, v) for n, v in outputs if not v.startswith("grad:param:")]
    param_grads = [(n, v) for n, v in outputs if v.startswith("grad:param:")]
    state = {n for n in placeholders if names[n].startswith(("param:", "buffer:"))}
    recompute = _fx.state_only_nodes(graph, state)
    input_body = _fx.ancestors([n for n, _ in input_grads]) - set(placeholders)
    weight_body = _fx.ancestors([n for n, _ in param_grads], stop=input_body) - set(placeholders) - input_body
    weight_body = _fx.with_state_ancestors(weight_body, recompute)
    input_body -= weight_body & recompute  # each graph recomputes its own parameter views

    weight_outputs = {n for n, _ in param_grads}
    stash = [
        n
        for n in graph.nodes
        if n in input_body - recompute and (any(u in weight_body for u in n.users) or n in weight_outputs)
    ]
    for node in stash:
        names[node] = f"stash:{node.name}"

    def reads(body: set[fx.Node], returned: set[fx.Node]) -> list[fx.Node]:
        return [
            n
            for n in graph.nodes
            if n not in body and n.op != "output" and (n in returned or any(u in body for u in n.users))
        ]

    input_program = extract_program(
        graph,
        body=input_body,
        inputs=reads(input_body, {n for n, _ in input_grads}),
        outputs=[*input_grads, *[(n, names[n]) for n in stash]],
        names=names,
        class_name=f"Stage{joint.stage}InputBackward",
    )
    weight_inputs = reads(weight_body, weight_outputs)
    weight_program = extract_program(
        graph,
        body=weight_body,
        inputs=weight_inputs,
        outputs=param_grads,
        names=names,
        class_name=f"Stage{joint.stage}WeightBackward",
    )
    weight_reads = tuple(names[n] for n in weight_inputs if n not in state)
    saved = [v for v in backward.signature.inputs if v.startswith(("saved:", "in:", "tangent:"))]
    return SplitBackward(
        stage=joint.stage,
        input_backward=input_program,
        weight_backward=weight_program,
        stash=tuple(names[n] for n in stash),
        weight_reads=weight_reads,
        freed_after_input=tuple(v for v in saved if v not in weight_reads),
    )


def _split_fused_ops(graph: fx.Graph, needed_by_input: set[fx.Node]) -> None:
    """Clone each op with an `output_mask` whose results feed both B and W into a B copy that
    computes only what B needs and a W copy that computes the rest."""
    for node in list(graph.nodes):
        mask_index = _output_mask_index(node)
        if mask_index is None or node not in needed_by_input:
            continue
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        for_input = {i for i, g in getitems.items() if g in needed_by_input}
        for_weight = {i for i, g in getitems.items() if g not in needed_by_input and g.users}
        if not for_weight:
            continue
        mask = node.args[mask_index]
        with graph.inserting_after(node):
            weight_node = graph.call_function(node.target, _with_mask(node.args, mask_index, mask, for_weight), node.kwargs)
            weight_node.meta = dict(node.meta)
        node.args = _with_mask(node.args, mask_index, mask, for_input)
        for i in for_weight:
            with graph.inserting_after(weight_node):
                replacement = graph.call_function(operator.getitem, (weight_node, i))
                replacement.meta = dict(getitems[i].meta)
            getitems[i].replace_all_uses_with(replacement)
            graph.erase_node(getitems[i])


def _output_mask_index(node: fx.Node) -> int | None:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name == "output_mask":
            return i if i < len(node.args) else None
    return None


def _with_mask(args: tuple, index: int, mask: list[bool], keep: set[int]) -> tuple:
    return (*args[:index], [bool(m) and i in keep for i, m in enumerate(mask)], *args[index + 1 :])
