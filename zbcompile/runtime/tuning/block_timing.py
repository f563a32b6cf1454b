"""Per-unit times inside a stage's actions, for the cut decision (`runtime/tuning/recut.py`).

A *unit* is what `passes/cut_profile.unit_key` names: the block an op belongs to
(`model.layers.7`) or the module outside any block. `marked(compiled, times)` is the compile with
every stage's F, I, W and B graphs copied with a mark before each run of ops of one unit and one at
the end: a call of `_unit_mark(slot)`. On the host (CPU) a mark reads `time.perf_counter()`; on
CUDA it records a timing event on the current (compute) stream, as `action_clock.EventClock`
does, and nothing waits for the device inside the step: `UnitTimes.medians()` reads the events
afterwards, waiting (with a timeout) for the last one alone. A device-wide synchronize would wait
for NCCL's receives posted for peers that may be waiting for this rank. The marks of one action,
in order, give each unit's time in it (a unit may run in several pieces; they add up). Running a
marked graph costs one Python call per piece: a few microseconds per action.

The graphs run are the compile's own FX graphs, op by op, whatever `compiler` compiled them with
(a marked step measures shares; the action totals come from the unmarked steps, `recut.py`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import torch
from torch import fx

from zbcompile.compiler import CompiledPipeline
from zbcompile.passes.cut_profile import unit_key
from zbcompile.passes.program import Program
from zbcompile.runtime.step.action_clock import cuda_event, wait_for_event
from zbcompile.runtime.step.stage_compiler import each_graph

UnitKey = tuple[int, str, str]  # (stage, action kind, unit)


class _Marks:
    """The marks of the action running now (one at a time on the step's thread), and how a mark
    is made: None for the host clock, else a timing event's constructor."""

    marks: list[tuple[int, Any]] = []
    event_type: Callable[[], Any] | None = None


def _unit_mark(slot: int) -> None:
    if _Marks.event_type is None:
        _Marks.marks.append((slot, time.perf_counter()))
    else:
        event = _Marks.event_type()
        event.record()
        _Marks.marks.append((slot, event))


@dataclass
class UnitTimes:
    """Seconds of each unit per action, by (stage, kind, unit): one entry per action run.
    `event_type`: None where marks are host times (CPU), else a timing event's constructor (a
    class with `record()`, `query()` and `elapsed_time(other)` in ms, as `torch.cuda.Event`)."""

    event_type: Callable[[], Any] | None = None
    samples: dict[UnitKey, list[float]] = field(default_factory=lambda: defaultdict(list))
    _unread: list[tuple[int, str, tuple[str, ...], list[tuple[int, Any]]]] = field(default_factory=list)

    def add(self, stage: int, kind: str, units: tuple[str, ...], marks: list[tuple[int, Any]]) -> None:
        """One action's marks (slot, host time or event), in order: read now on the host, after
        the step (`medians`) for events."""
        if self.event_type is None:
            self._add_seconds(stage, kind, units, marks)
        else:
            self._unread.append((stage, kind, units, marks))

    def medians(self, timeout_s: float = 300.0) -> dict[UnitKey, float]:
        """Each unit's median seconds per action, once the device has run the marked actions
        (waiting at most `timeout_s` for the last event)."""
        if self._unread:
            wait_for_event(self._unread[-1][3][-1][1], timeout_s, "the marked step's work")
            origin = self._unread[0][3][0][1]
            for stage, kind, units, marks in self._unread:
                self._add_seconds(stage, kind, units, [(s, origin.elapsed_time(e) / 1e3) for s, e in marks])
            self._unread = []
        return {key: statistics.median(values) for key, values in self.samples.items() if values}

    def _add_seconds(self, stage: int, kind: str, units: tuple[str, ...], marks: list[tuple[int, float]]) -> None:
        spent: dict[str, float] = defaultdict(float)
        for (slot, start), (_, end) in zip(marks, marks[1:]):
            spent[units[slot]] += end - start
        for unit, seconds in spent.items():
            self.samples[(stage, kind, unit)].append(seconds)


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
        _Marks.marks, _Marks.event_type = [], self.times.event_type
        super().run(env, state, consumed)
        marks, _Marks.marks = _Marks.marks, []
        self.times.add(self.stage, self.kind, self.units, marks)


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


def unit_times(device: torch.device | None) -> UnitTimes:
    """Empty `UnitTimes` for marked programs running on `device`: events on CUDA, host times
    elsewhere."""
    return UnitTimes(event_type=cuda_event if device is not None and device.type == "cuda" else None)


def marked(compiled: CompiledPipeline, times: UnitTimes) -> CompiledPipeline:
    """`compiled` with every stage's programs marked (`MarkedProgram`), their units' seconds
    added to `times` (made by `unit_times` for the device they run on)."""

    def mark(program: Program, stage: int, kind: str) -> Program:
        graph, units = _marked_graph(program.graph)
        return MarkedProgram(graph, program.signature, units=units, stage=stage, kind=kind, times=times)

    return dataclasses.replace(compiled, programs=tuple(each_graph(p, mark) for p in compiled.programs))
