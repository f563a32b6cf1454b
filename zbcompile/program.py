"""The executable stage program: an FX graph and its calling convention.

Every graph the compiler produces (a stage's forward F, its input-gradient I and weight-gradient
W backward, its whole backward; a `torch.compile` region's backward) is a pure function over
named values, which the runtime keeps in a per-microbatch environment. `Signature` names the
values a graph reads and returns (see `value_names` for the names), and `Program` runs the graph
on an environment. The compiler passes build Programs (`passes.joint.extract_program`); the
runtime, the `torch.compile` backend and the cost model run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import fx


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

    def run(self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
        """Call the graph on the values named in its signature, looked up in `env` and then in
        `state` (parameters and buffers), and store its results into `env`."""
        with torch.no_grad():  # the graphs are the forward and backward: nothing to record
            results = self.graph(*[env[n] if n in env else state[n] for n in self.signature.inputs])
        env.update(zip(self.signature.outputs, results))
