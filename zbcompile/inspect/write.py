"""Dumps of what the compiler did, for people (`zbcompile inspect DIR`) and for tools.

With `ZBCOMPILE_DUMP=dir` in the environment or `pipeline(..., dump_dir=dir)`, every compile
writes `dir/compile-<n>/` (n counts this process's compiles under `dir`; every rank compiles
in the same order, so all ranks agree on it):

    compile.json          the model, options, compile times and per-stage facts (`text.stage_rows`)
    stages.txt            the per-stage table: parameters and bytes, FLOPs of F/I/W, M_B, M_W,
                          boundary values and bytes
    forward.py            the traced forward + loss graph, each node with the stage that runs it
    stage<s>/F.py I.py W.py B.py
                          the stage's forward, input-gradient (I), weight-gradient (W) and unsplit
                          backward graphs as code, headed by their calling convention
    schedule.txt .csv     the schedule (grid; torch's compute-only CSV) with the simulator's prediction
    schedule.json         every schedule version the pipeline ran (one measuring its costs
                          re-solves with them): actions, lowered actions, the costs it was made
                          with, the prediction (makespan, span, bubble rates, peak memory,
                          per-action times)
    timeline-rank<r>.jsonl, trace.json
                          measured per-action times of every step on every rank (`inspect.timelines`)

Rank 0 writes the compile files; every rank writes its own timeline. Nothing here adds a
collective operation: `zbcompile inspect` (or `inspect.timelines.write_trace`) merges the timelines.
The file names are `inspect.read`'s, which reads them back; `live_dump` gives the same records
without writing them (`pipe.explain()`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from zbcompile.inspect.read import COMPILE_FILE, FORWARD_FILE, GRAPH_FILES, SCHEDULE_FILE, Dump
from zbcompile.inspect.text import format_schedule, format_stages, stage_rows, state_rows
from zbcompile.inspect.timelines import append_step, chrome_trace, read_timelines, start_timeline
from zbcompile.options import PipelineOptions
from zbcompile.schedules import Costs, Schedule, lower, simulate
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.validate import rank_limits

if TYPE_CHECKING:
    from zbcompile.compiler import CompiledPipeline
    from zbcompile.passes.program import Program

DUMP_ENV = "ZBCOMPILE_DUMP"
GRAPH_TITLES = {
    "F": "forward",
    "I": "input-gradient backward: gradients of the stage inputs, and the stash W needs",
    "W": "weight-gradient backward: parameter gradients",
    "B": "the fused backward: the whole backward before the I/W split",
}
_counters: dict[str, itertools.count] = {}


def dump_root(dump_dir: str | os.PathLike | None) -> str | None:
    """Where dumps go: `dump_dir`, else `$ZBCOMPILE_DUMP`, else nowhere (None)."""
    root = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV) or None
    return os.fspath(root) if root is not None else None


# --- records (plain JSON-able dicts; `zbcompile inspect` reads them back) -----------------------


def compile_record(compiled: "CompiledPipeline", options: PipelineOptions, world: dict[str, Any]) -> dict[str, Any]:
    """What `compile.json` holds: the model, the pipeline's options, compile times, per-stage
    facts, tied weights, the bytes of one schedule memory unit and the process layout."""
    return _plain(
        {
            "format": 1,
            "model": type(compiled.traced.model).__name__,
            "stages": len(compiled.programs),
            "microbatches": options.microbatches,
            "options": {
                "schedule": options.schedule if isinstance(options.schedule, str) else options.schedule.name,
                "memory_limit": options.memory_limit,
                "objective": options.objective,
                "profile": options.profile,
                "split_points": options.split_points,
            },
            "phase_seconds": dict(compiled.phase_seconds),
            "stage_rows": stage_rows(compiled),
            "tied": {fqn: list(stages) for fqn, stages in compiled.partition.shared_params.items()},
            "memory_unit": compiled.memory_unit(),
            "recompute": compiled.recompute_choice(),
            "cut": compiled.cut_record,
            "symbolic": compiled.traced.symbols.describe() if compiled.traced.symbols is not None else None,
            "world": world,
        }
    )


def schedule_costs_used(schedule: Schedule, compiled: "CompiledPipeline", measured: Costs | None) -> tuple[Costs, str]:
    """The costs `schedule` was made with and where they came from ("measured": seconds the
    pipeline measured, those it was solved with (`info["costs"]`), else `measured`; "given":
    `pipeline(costs=...)`; "static": the compiler's FLOP-equivalent estimates), with each stage's
    gradient reduction time the schedule was solved with where the pipeline has replicas
    (`info["reduction"]`, in the static or given costs' unit)."""
    source, made_with = schedule.info.get("cost_source"), schedule.info.get("costs")
    if source == "measured" and (isinstance(made_with, Costs) or measured is not None):
        costs, source = made_with if isinstance(made_with, Costs) else measured, "measured"
    elif source == "given" and isinstance(made_with, Costs):
        costs, source = made_with, "given"
    else:
        costs, source = compiled.schedule_costs(), "static"
    if source != "measured" and "reduction" in schedule.info and not any(resolve_costs(costs, schedule.stages).reduce):
        costs = replace(costs, reduce=tuple(schedule.info["reduction"]))
    return costs, source


def schedule_record(
    schedule: Schedule, costs: Costs, cost_source: str, memory_unit: int, version: int
) -> dict[str, Any]:
    """One entry of `schedule.json`: the schedule, its lowering, its costs, the memory limit it
    was made under (per rank, in units; None: none) and the simulator's prediction under them
    (times in the costs' unit, memory in units and bytes)."""
    resolved = resolve_costs(costs, schedule.stages)
    result = simulate(schedule, resolved)
    limits = rank_limits(schedule.info.get("memory_limit"), len(schedule.actions))
    return _plain(
        {
            "version": version,
            "name": schedule.name,
            "stages": schedule.stages,
            "microbatches": schedule.microbatches,
            "stage_to_rank": list(schedule.stage_to_rank),
            "mirrored_from": schedule.mirrored_from,
            "actions": schedule.compute_only().rows_as_text(),
            "lowered": lower(schedule).rows_as_text(),
            "cost_source": cost_source,
            "time_unit": {"measured": "s", "static": "FLOP-eq"}.get(cost_source, "given unit"),
            "costs": {k: getattr(resolved, k) for k in ("f", "i", "w", "comm", "mem_b", "mem_w", "reduce")},
            "memory_limit": limits,
            "prediction": {
                **{k: getattr(result, k) for k in _PREDICTED},
                "peak_memory_bytes": [p * memory_unit for p in result.peak_memory],
                "start": {str(a): t for a, t in result.start.items()},
                "end": {str(a): t for a, t in result.end.items()},
            },
            "info": {k: v for k, v in schedule.info.items() if isinstance(v, (str, int, float, bool, type(None)))},
        }
    )


_PREDICTED = ("makespan", "span", "bubble_rate", "stage_bubble_rate", "busy", "peak_memory")


def _plain(value: Any) -> Any:
    """`value` as JSON reads it back (tuples become lists), so in-memory and dumped records match."""
    return json.loads(json.dumps(value, default=str))


# --- graphs as code ---------------------------------------------------------------------------

_ANNOTATION = re.compile(r"^(\s*)# Annotation: .*'module': '([^']*)'.*$")
_DELETIONS = re.compile(r";  (\w+ = )+None$")
_ASSIGNED = re.compile(r"^\s+(\w+): ")


def readable_code(graph_module: Any, header: list[str], note: Callable[[str], str | None] | None = None) -> str:
    """`graph_module` as Python (`print_readable`), without the `x = None` deletions and
    source-location comments, module annotations shortened to `# module <fqn>`, headed by
    `header` comment lines; `note(node_name)` adds a trailing comment to an assignment."""
    lines = [f"# {line}" if line else "#" for line in header]
    text = graph_module.print_readable(print_output=False, include_stride=False, include_device=False)
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# File:") or stripped == "# No stacktrace found for following nodes":
            continue
        annotation = _ANNOTATION.match(line)
        if annotation:
            line = f"{annotation.group(1)}# module {annotation.group(2)}"
        line = _DELETIONS.sub("", line)
        assigned = _ASSIGNED.match(line)
        comment = note(assigned.group(1)) if note and assigned else None
        lines.append(f"{line}  # {comment}" if comment else line)
    return "\n".join(lines).rstrip() + "\n"


def program_code(program: "Program", stage: int, graph: str) -> str:
    """One stage graph as code, headed by its calling convention: which environment value
    (`param:`, `in:`, `saved:`, `tangent:`, `stash:`...) each placeholder is, and what it returns."""
    placeholders = [n.name for n in program.graph.graph.find_nodes(op="placeholder")]
    header = [f"stage {stage}, {graph}: {GRAPH_TITLES[graph]}", "inputs:"]
    header += [f"  {p} <- {name}" for p, name in zip(placeholders, program.signature.inputs)] or ["  (none)"]
    header += ["returns, in order:"] + ([f"  {name}" for name in program.signature.outputs] or ["  (nothing)"])
    return readable_code(program.graph, header)


def forward_code(compiled: "CompiledPipeline") -> str:
    """The traced forward + loss, each computed node marked with its stage."""
    traced, partition = compiled.traced, compiled.partition
    header = [
        "the traced forward + loss of one microbatch; `# stage s`: the stage that computes a node,",
        "`# every stage that uses it`: depends only on parameters and constants, recomputed where needed",
        "inputs:",
    ]
    header += [
        f"  {n.name} <- {n.meta['zb_role']} {n.meta['zb_name']}"
        for n in traced.graph_module.graph.find_nodes(op="placeholder")
    ]
    computed = {n.name for n in traced.graph_module.graph.nodes if n.op == "call_function"}

    def note(name: str) -> str | None:
        if name in partition.stage_of_node:
            return f"stage {partition.stage_of_node[name]}"
        return "every stage that uses it" if name in computed else None

    return readable_code(traced.graph_module, header, note)


# --- the dump of one compile -----------------------------------------------------------------


class CompileDump:
    """The files of one compile. `record_step(runner)` after each step appends this rank's
    measured actions and, when the pipeline switched schedules, records the new one."""

    def __init__(self, directory: str, rank: int, compiled: "CompiledPipeline", schedule: Schedule) -> None:
        self.directory = directory
        self.rank = rank
        self.compiled = compiled
        self.versions: list[Schedule] = []
        self.records: list[dict[str, Any]] = []
        self.steps = 0
        self.timeline: str | None = None
        self._add_version(schedule, None)

    @property
    def writes_compile(self) -> bool:
        return self.rank == 0

    def write_compile(self, options: PipelineOptions, world: dict[str, Any]) -> None:
        record = compile_record(self.compiled, options, world)
        self._write(COMPILE_FILE, json.dumps(record, indent=1))
        self._write("stages.txt", format_stages(record["stage_rows"], record["tied"]) + "\n")
        self._write(FORWARD_FILE, forward_code(self.compiled))
        for program in self.compiled.programs:
            graphs = ("F", program.forward), ("I", program.input_backward), ("W", program.weight_backward)
            for graph, prog in (*graphs, ("B", program.joint.backward)):
                self._write(
                    os.path.join(f"stage{program.index}", GRAPH_FILES[graph]), program_code(prog, program.index, graph)
                )
        self._write_schedules()

    def start_timeline(self, header: dict[str, Any]) -> None:
        self.timeline = start_timeline(self.directory, header)

    def record_step(self, runner: Any, measured: Costs | None = None) -> None:
        """Append the step `runner` just ran (its compute and communication timelines) to this
        rank's timeline file; a schedule different from the last one seen becomes a new version."""
        if runner.schedule != self.versions[-1]:
            self._add_version(runner.schedule, measured)
            if self.writes_compile:
                self._write_schedules()
        if self.timeline is None:  # one process: no per-rank timeline
            return
        events = sorted([*runner.timeline, *runner.comm_timeline], key=lambda e: e[1])
        record = {
            "step": self.steps,
            "schedule_version": len(self.versions) - 1,
            "events": [[text, start, end] for text, start, end in events],
            "peak_live_bytes": runner.peak_live_bytes,
            "moved_w": {how: list(ws) for how, ws in getattr(runner, "moved_w", {}).items()},
        }
        append_step(self.timeline, record)
        self.steps += 1

    def _add_version(self, schedule: Schedule, measured: Costs | None) -> None:
        costs, source = schedule_costs_used(schedule, self.compiled, measured)
        self.versions.append(schedule)
        self.records.append(
            schedule_record(schedule, costs, source, self.compiled.memory_unit(), len(self.versions) - 1)
        )

    def _write_schedules(self) -> None:
        latest, schedule = self.records[-1], self.versions[-1]
        prediction = format_schedule(latest, len(self.records), self.compiled.memory_unit())
        self._write(SCHEDULE_FILE, json.dumps({"versions": self.records}, indent=1))
        self._write("schedule.csv", schedule.compute_only().to_csv())
        self._write("schedule.txt", prediction + "\n\n" + schedule.compute_only().grid())

    def _write(self, name: str, text: str) -> None:
        path = os.path.join(self.directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def start_dump(
    dump_dir: str | os.PathLike | None, compiled: "CompiledPipeline", schedule: Schedule, options: PipelineOptions,
    runner: Any,
) -> CompileDump | None:
    """Begin the dump of a compile (None when dumping is off): rank 0 writes the compile's files,
    every rank of a distributed run starts its timeline."""
    root = dump_root(dump_dir)
    if root is None:
        return None
    index = next(_counters.setdefault(os.path.abspath(root), itertools.count()))
    directory = os.path.join(root, f"compile-{index}")
    os.makedirs(directory, exist_ok=True)
    layout = getattr(runner, "layout", None)
    dump = CompileDump(directory, runner.rank if layout is not None else 0, compiled, schedule)
    if layout is not None:
        dump.start_timeline(
            {
                "rank": runner.rank,
                "pp_rank": layout.pp_rank,
                "dp_rank": layout.dp_rank,
                "stages": list(runner.local_stages),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "clock": {"perf_counter": time.perf_counter(), "time": time.time()},
            }
        )
    if dump.writes_compile:
        dump.write_compile(options, world_of(runner, schedule, options.grad_dtype))
    return dump


def world_of(runner: Any, schedule: Schedule, grad_dtype: Any = None) -> dict[str, Any]:
    """How the pipeline runs: distributed or in one process, world size, ranks per pipeline,
    data-parallel replicas and mode, and each pipeline rank's bytes of parameters, gradients (in
    `grad_dtype` where given) and optimizer state (`text.state_rows`)."""
    layout = getattr(runner, "layout", None)
    replicas = 1 if layout is None else layout.dp_size
    mode = getattr(runner, "data_parallel", "replicate") if replicas > 1 else "replicate"
    stages_on = [schedule.stages_on(rank) for rank in range(schedule.ranks)]
    data_parallel = {
        "replicas": replicas,
        "data_parallel": mode,
        "state_bytes": state_rows(runner.compiled, stages_on, replicas, mode, grad_dtype),
    }
    if layout is None:
        return {"distributed": False, "world_size": 1, "ranks_per_pipeline": schedule.ranks, **data_parallel}
    world = layout.pp_size * layout.dp_size
    return {"distributed": True, "world_size": world, "ranks_per_pipeline": layout.pp_size, **data_parallel}


def live_dump(pipe: Any, compile_dump: CompileDump | None = None) -> Dump:
    """What a dump of `pipe`'s latest compile holds, built in memory: the compile record, the
    schedule versions (`compile_dump`'s, else the current schedule's) and the trace merged from
    `compile_dump`'s rank timelines (every rank's that has written)."""
    compiled, schedule = pipe.compiled, pipe.schedule
    record = compile_record(compiled, pipe.options, world_of(pipe.runner, schedule, pipe.options.grad_dtype))
    if compile_dump is None:
        costs, source = schedule_costs_used(schedule, compiled, pipe.measured_costs)
        return Dump(None, record, [schedule_record(schedule, costs, source, compiled.memory_unit(), 0)], None)
    timelines = read_timelines(compile_dump.directory)
    trace = chrome_trace(timelines) if timelines else None
    return Dump(compile_dump.directory, record, list(compile_dump.records), trace)
