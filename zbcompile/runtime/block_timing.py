"""Per-unit times inside a stage's actions, for the cut decision (`runtime/recut.py`).

A *unit* is what `passes/cut_profile.unit_key` names: the block an op belongs to
(`model.layers.7`) or the module outside any block. `marked(compiled, times)` is the compile with
every stage's F, I, W and B graphs copied with a mark before each run of ops of one unit and one at
the end: a call of `_unit_mark(slot)`, which reads the host clock (`time.perf_counter()`; on CUDA
after a synchronize, so the interval is the device's work: a measurement step only). The marks
of one action, in order, give each unit's time in it (a unit may run in several pieces; they add
up). Running a marked graph costs one Python call per piece: a few microseconds per action.

The graphs run are the compile's own FX graphs, op by op, whatever `compiler` compiled them with
(a marked step measures shares; the action totals come from the unmarked steps, `recut.py`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Collection, Mapping

import torch
from torch import fx

from zbcompile.compiler import CompiledPipeline, StageProgram
from zbcompile.passes.cut_profile import unit_key
from zbcompile.program import Program

UnitKey = tuple[int, str, str]  # (stage, action kind, unit)


class _Marks:
    """The marks of the action running now (one at a time on the step's thread)."""

    marks: list[tuple[int, float]] = []
    synchronize = False


def _unit_mark(slot: int) -> None:
    if _Marks.synchronize:
        torch.cuda.synchronize()
    _Marks.marks.append((slot, time.perf_counter()))


@dataclass
class UnitTimes:
    """Seconds of each unit per action, by (stage, kind, unit): one entry per action run."""

    samples: dict[UnitKey, list[float]] = field(default_factory=lambda: defaultdict(list))

    def medians(self) -> dict[UnitKey, float]:
        return {key: statistics.median(values) for key, values in self.samples.items() if values}


@dataclass(frozen=True)
class MarkedProgram(Program):
    """A Program whose graph marks where each unit's ops begin (see the module docstring); each
    run adds its units' seconds to `times` under (`stage`, `kind`)."""

    units: tuple[str, ...] = ()
    stage: int = 0
    kind: str = ""
    times: UnitTimes | None = field(default=None, compare=False)

    def run(
        self, env: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], consumed: Collection[str] = ()
    ) -> None:
        _Marks.marks = []
        super().run(env, state, consumed)
        marks, _Marks.marks = _Marks.marks, []
        spent: dict[str, float] = defaultdict(float)
        for (slot, start), (_, end) in zip(marks, marks[1:]):
            spent[self.units[slot]] += end - start
        for unit, seconds in spent.items():
            self.times.samples[(self.stage, self.kind, unit)].append(seconds)


def _marked_graph(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A copy of `graph_module` with a `_unit_mark` call before each run of one unit's ops and
    before its output; and the unit of each slot."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    units: list[str] = []
    current = None
    for node in list(graph.nodes):
        if node.op == "output" or (node.op == "call_function" and unit_key(node) != current):
            current = unit_key(node) if node.op != "output" else None
            with graph.inserting_before(node):
                graph.call_function(_unit_mark, (len(units),))
            units.append(current or "")
    return fx.GraphModule(graph_module, graph, class_name=type(graph_module).__name__), tuple(units)


def _marked_program(program: Program, stage: int, kind: str, times: UnitTimes) -> Program:
    if not any(n.op == "call_function" for n in program.graph.graph.nodes):
        return program  # nothing runs (the first stage's I): nothing to time
    graph, units = _marked_graph(program.graph)
    return MarkedProgram(graph, program.signature, units=units, stage=stage, kind=kind, times=times)


def marked(compiled: CompiledPipeline, times: UnitTimes, device: torch.device | None = None) -> CompiledPipeline:
    """`compiled` with every stage's programs marked (`MarkedProgram`), their units' seconds
    added to `times`; on a CUDA `device` each mark waits for the device first."""
    _Marks.synchronize = device is not None and device.type == "cuda"

    def stage(program: StageProgram) -> StageProgram:
        s, joint, split = program.index, program.joint, program.split
        return dataclasses.replace(
            program,
            joint=dataclasses.replace(
                joint, forward=_marked_program(joint.forward, s, "F", times),
                backward=_marked_program(joint.backward, s, "B", times),
            ),
            split=dataclasses.replace(
                split, input_backward=_marked_program(split.input_backward, s, "I", times),
                weight_backward=_marked_program(split.weight_backward, s, "W", times),
            ),
        )

    return dataclasses.replace(compiled, programs=tuple(stage(p) for p in compiled.programs))
