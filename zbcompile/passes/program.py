"""The executable stage program: an FX graph and its calling convention.

Every graph the compiler produces (a stage's forward F, its input-gradient I and weight-gradient
W backward, its whole backward; a `torch.compile` region's backward) is a pure function over
named values, which the runtime keeps in a per-microbatch environment. `Signature` names the
values a graph reads and returns (see `value_names` for the names), and `Program` runs the graph
on an environment. The compiler passes build Programs (`passes.joint.extract_program`); the
runtime, the `torch.compile` backend and the cost model run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

import torch
from torch import fx

from zbcompile import _torch_internals as ti


@dataclass(frozen=True)
class Signature:
    """Environment names of a graph's placeholders and of the values it returns, in order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Program:
    """A graph and its calling convention: `graph(*env[inputs]) -> env[outputs]`."""

    graph: fx.GraphModule
    signature: Signature
    _boxed: dict[str, fx.GraphModule] = field(default_factory=dict, compare=False, repr=False)

    def run(
        self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], consumed: Collection[str] = ()
    ) -> None:
        """Call the graph on the values named in its signature, looked up in `env` and then in
        `state` (parameters and buffers), and store its results into `env`. The values named in
        `consumed` leave `env`, and the graph frees each at its last use (unless the caller holds
        it elsewhere): it takes its inputs in a list it empties (`ti.boxed_copy`)."""
        with torch.no_grad():  # the graphs are the forward and backward: nothing to record
            if consumed:
                results = self._boxed_graph()(self._inputs(env, state, consumed))
            else:
                results = self.graph(*self._inputs(env, state, ()))
        env.update(zip(self.signature.outputs, results))

    def _inputs(
        self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], consumed: Collection[str]
    ) -> list:
        """The graph's inputs in order; those named in `consumed` taken out of `env`."""
        return [env.pop(n) if n in consumed else env[n] if n in env else state[n] for n in self.signature.inputs]

    def failing_node(self, error: BaseException) -> fx.Node | None:
        """The node whose op raised `error` during `run` (None where it did not come from one)."""
        for graph in (self.graph, *self._boxed.values()):
            node = ti.failing_node(graph, error)
            if node is not None:
                return node
        return None

    def _boxed_graph(self) -> fx.GraphModule:
        if "graph" not in self._boxed:
            self._boxed["graph"] = ti.boxed_copy(self.graph)
        return self._boxed["graph"]
