"""Pass: a stage's forward alone, as a program that keeps nothing for a backward.

`forward_program(stage, result_names)` turns a partitioned stage module (`partition.Stage`) into
a `Program` over the runtime's value names: its placeholders read `in:<value>`, the parameters
and buffers it reads become inputs `param:<fqn>` and `buffer:<fqn>`, and it returns `out:<value>`
for every boundary value it sends on (on the last stage `out:<name>` for each of
`result_names`), then `update:<fqn>` for every buffer it updates. No autograd graph is traced:
evaluation runs the stage's traced forward ops as they are.
"""

from __future__ import annotations

from typing import Sequence

from torch import fx

from zbcompile.passes.joint import extract_program
from zbcompile.passes.partition import Stage
from zbcompile.passes.program import Program
from zbcompile.value_names import buffer_name, input_name, output_name, param_name, update_name


def forward_program(stage: Stage, result_names: Sequence[str] | None = None) -> Program:
    """The stage's forward as a Program; `result_names` name the last stage's results (None:
    the stage's boundary outputs)."""
    graph = stage.module.graph
    names: dict[fx.Node, str] = {}
    for node, value in zip(graph.find_nodes(op="placeholder"), stage.graph_inputs):
        names[node] = input_name(value)
    for node in graph.find_nodes(op="get_attr"):
        fqn = stage.state_fqns.get(node.target)
        if fqn is not None:
            names[node] = param_name(fqn) if fqn in stage.param_fqns else buffer_name(fqn)
    returned = list(graph.output_node().args[0])
    outputs = list(result_names) if result_names is not None else list(stage.graph_outputs)
    named_outputs = [
        *[(node, output_name(name)) for node, name in zip(returned, outputs)],
        *[(node, update_name(fqn)) for node, fqn in zip(returned[len(outputs) :], stage.buffer_updates)],
    ]
    body = {n for n in graph.nodes if n.op == "call_function" or (n.op == "get_attr" and n not in names)}
    return extract_program(graph, body, list(names), named_outputs, names, class_name=f"Stage{stage.index}ForwardOnly")
