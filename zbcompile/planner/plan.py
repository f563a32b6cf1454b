"""`zbcompile.plan()`: size a pipelined training run before the GPUs.

    report = zbcompile.plan(model, tokens, labels=tokens, stages=8, microbatches=32, dp=8, hardware="H100-80GB")
    print(report)                       # stages, memory per rank, schedules, zb-auto's choice
    report.write_svg("zb-auto", "timeline.svg")

The model may live on the meta device and the batch may be meta tensors: the compiler traces
with fake tensors and never materialises a parameter. Stages whose programs are identical are
compiled once (`compiler.compile_costs`). Per-pass times come from a `Hardware` profile
(`planner/hardware.py`), memory from the compiled graphs (M_B, M_W and each action's own peak) plus the
state each rank holds (`planner/report.state_bytes`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile._torch_internals import pytree
from zbcompile.compiler import CostedPipeline, compile_costs
from zbcompile.inspect.text import stage_rows_of
from zbcompile.inspect.units import si
from zbcompile.passes.stage_cost import peak_memory_with_transients
from zbcompile.passes.tensor_parallel_shares import annotate_shares, model_plan
from zbcompile.planner.cut import binds, cut_decision, decision_record, one_f_one_b_peaks
from zbcompile.planner.hardware import Hardware, resolve_rank_hardware
from zbcompile.planner.layouts import LayoutPlan, menu_record, nearest_layouts, plan_layouts
from zbcompile.planner.pricing import Layout, Solves
from zbcompile.planner.report import plan_text
from zbcompile.runtime.parallel.batch import split
from zbcompile.schedules import Costs, Schedule, ScheduleError, make_schedule, simulate
from zbcompile.schedules.costs import resolve_costs
from zbcompile.schedules.memory_limit import DATA_PARALLEL_MODES, parse_bytes, state_bytes
from zbcompile.schedules.render import layout, to_svg

PLANNED_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "gpipe", "zb-auto")
NEAREST_SECONDS = 20.0  # the search for the nearest layouts that fit, past their compile


@dataclass(frozen=True)
class Plan:
    """What `plan()` found: the compile (`costed`), the hardware (`rank_hardware`: each rank's;
    `hardware`: the first rank's), per-stage costs in seconds and bytes (`costs`, memory in units
    of `unit_bytes`), each rank's memory limit (`limits`), each planned schedule by name, and the
    JSON-able `record` the report prints (`str(plan)`)."""

    costed: CostedPipeline
    hardware: Hardware
    costs: Costs
    unit_bytes: float
    state: tuple[float, ...]
    schedules: dict[str, Schedule]
    record: dict[str, Any]
    options: "PlanOptions"
    microbatch: str = ""
    rank_hardware: tuple[Hardware, ...] = ()
    limits: tuple[float, ...] = ()

    def on(self, hardware: Hardware | str | Sequence[Hardware | str]) -> "Plan":
        """The same compile planned on other hardware (`Hardware.from_measured`'s calibration, say;
        or one per rank)."""
        return plan_compiled(self.costed, hardware, self.options, self.microbatch)

    def static_costs(self) -> list[dict[str, Any]]:
        """Per stage, its F, I and W `GraphCost`s: `Hardware.from_measured`'s `static`."""
        return [pass_costs(c) for c in self.costed.costs]

    def __str__(self) -> str:
        return plan_text(self.record)

    def peak_bytes(self, schedule: Schedule) -> list[float]:
        """Per rank: the state of every stage it runs (a V's two chunks) + the simulated peak
        activations, each action's own peak included."""
        activations = peak_memory_with_transients(schedule, self.costs, self.costed.costs, self.unit_bytes)
        held = [0.0] * len(activations)
        for stage, rank in enumerate(schedule.stage_to_rank):
            held[rank] += self.state[stage]
        return [state + peak * self.unit_bytes for state, peak in zip(held, activations)]

    def svg(self, name: str) -> str:
        """The predicted timeline of the planned schedule `name`, as an SVG document."""
        if name not in self.schedules:
            raise ValueError(
                f"schedule {name!r} was not planned (or did not fit); planned: {', '.join(self.schedules)}"
            )
        schedule = self.schedules[name]
        title = (
            f"{name}: {schedule.stages} stages, {schedule.microbatches} microbatches, predicted on {self.hardware.name}"
        )
        return to_svg(layout(schedule, self.costs), title=title, legend=True)

    def write_svg(self, name: str, path: str | os.PathLike) -> None:
        with open(path, "w") as file:
            file.write(self.svg(name))


def plan(
    model: nn.Module, *inputs: Any, stages: int | None = None, microbatches: int | None = None, target: Any = None,
    hardware: Hardware | str | Sequence[Hardware | str] = "H100-80GB", dp: int = 1, data_parallel: str = "replicate",
    memory_limit: float | str | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
    split_points: Sequence[str] | None = None, schedules: Sequence[str] = PLANNED_SCHEDULES,
    optimizer_factor: float = 2.0, grad_factor: float = 1.0, time_budget: float = 1.0, tp: int = 1,
    tensor_parallel: Mapping[str, Any] | None = None, sequence_parallel: bool = False, gpus: int | None = None,
    gpus_per_node: int = 8, **kwargs: Any,
) -> "Plan | LayoutPlan":
    """Plan `stages` pipeline stages over `microbatches` microbatches of the batch `inputs`,
    `kwargs`, `target` (one data-parallel replica's, as `step()` takes it; meta tensors welcome)
    on `hardware` (a `Hardware`, a name from `hardware.NAMED` or a JSON file; or a list of them,
    one per rank: ranks of different kinds), with `dp` data-parallel replicas keeping their state
    as `data_parallel` says ("replicate" or "shard", see `planner/report.py`), against
    `memory_limit` bytes per rank (default: each rank's device memory). `optimizer_factor` and
    `grad_factor`: bytes of optimizer state and of gradients per byte of parameters (AdamW in the
    parameters' dtype: 2 and 1). `schedules`: which to plan (schedules of one stage per rank);
    zb-auto is solved under each rank's memory left after its state. The model is cut where the
    compiler balances its FLOPs, unless (without `split_points`) the memory limit binds or the
    ranks differ: then where the predicted step time is least (`planner/cut.py`). `tp`
    tensor-parallel ranks per stage (inside a node) split the modules `tensor_parallel` names
    ({module-FQN pattern: ColwiseParallel() / RowwiseParallel() or "colwise" / "rowwise"}; default:
    a transformers model's own plan), with `sequence_parallel` the rest of the activations too
    (`passes/tensor_parallel_shares.py`: each rank's FLOPs, bytes and state, and the collectives'
    time on the hardware's `intra_node_bandwidth`). Where no schedule of the menu fits, the
    record also names the nearest layouts of as many GPUs that do (`planner/layouts.py`).

    With `gpus` (no `stages`, `microbatches`, `dp`, `tp`), the batch is the global batch and the
    answer the fastest layouts of `gpus` GPUs that fit (`layouts.plan_layouts`)."""
    search_options = dict(
        hardware=hardware, memory_limit=memory_limit, loss_fn=loss_fn, optimizer_factor=optimizer_factor,
        grad_factor=grad_factor, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
    )
    if gpus is not None:
        if stages is not None or microbatches is not None or dp != 1 or tp != 1:
            raise ValueError("plan(gpus=...) searches the layout: give no stages, microbatches, dp or tp with it")
        return plan_layouts(model, inputs, kwargs, target, gpus=gpus, gpus_per_node=gpus_per_node, **search_options)
    if stages is None or microbatches is None:
        raise ValueError("plan() needs stages= and microbatches= (a given layout), or gpus= (a layout searched)")
    micro_inputs, micro_targets, _ = split(inputs, kwargs, target, microbatches)
    (args, call_kwargs), micro_target = micro_inputs[0], micro_targets[0]
    _check_options(dp, data_parallel, tp)
    rank_hardware = resolve_rank_hardware(hardware, stages)
    annotate = None
    if tp > 1:
        parallel_plan = model_plan(model, tensor_parallel)
        annotate = lambda traced: annotate_shares(traced, parallel_plan, tp, sequence_parallel)  # noqa: E731

    def compiled(cuts: Sequence[int] | None = None, traced: Any = None, alternatives: bool = False) -> CostedPipeline:
        # traced as on a CPU (fake tensors, nothing allocated): its attention kernel saves what a GPU's
        # flash attention saves (no sequence x sequence scores); the meta device's would keep them.
        # Given the trace (the first compile's), not traced again; with `alternatives` compiled again at
        # every recompute level too, for the menu
        return compile_costs(
            model, loss_fn, args, call_kwargs, micro_target, stages, split_points, device=torch.device("cpu"),
            annotate=annotate, cuts=cuts, traced=traced, recompute_alternatives=alternatives,
        )

    options = PlanOptions(
        microbatches, dp, data_parallel, memory_limit, tuple(schedules), optimizer_factor, grad_factor, time_budget,
        tp,
    )
    solves = Solves()  # every schedule this plan makes, made once
    planned = plan_compiled(compiled(), rank_hardware, options, _shapes(args, call_kwargs), solves)
    planned = planned if split_points is not None else _cut_by_time(planned, compiled, solves)
    return _priced_menu(planned, compiled, model, (inputs, kwargs, target), search_options, solves)


def _priced_menu(
    planned: Plan, compiled: Callable, model: nn.Module, batch: tuple, search_options: dict, solves: Solves
) -> Plan:
    """`planned` with its menu priced at every recompute level where some level is worth it
    (`compiled(cuts, traced, alternatives=True)` compiles them), and the nearest layouts that fit where nothing on
    the menu does; `solves`: the schedules this plan made so far."""
    if planned.record.get("menu_binds"):
        again = compiled(planned.costed.partition.cuts, planned.costed.traced, alternatives=True)
        planned.record.update(menu_record(again, planned.hardware, planned.options, min(planned.limits), solves))
    if "menu" in planned.record and planned.record["menu_choice"] is None:
        planned.record.update(_nearest(model, batch, len(planned.state), planned.options, search_options, solves))
    return planned


def _nearest(
    model: nn.Module, batch: tuple, stages: int, o: PlanOptions, search_options: dict, solves: Solves
) -> dict[str, Any]:
    """The layouts of as many GPUs nearest to `stages` x `o`'s that fit, for one replica's `batch`
    (inputs, kwargs, target) repeated over `o.dp` replicas: `layouts.nearest_layouts`' record,
    searched for at most `NEAREST_SECONDS` past the compile."""
    whole = pytree.tree_map(lambda x: torch.cat([x] * o.dp) if isinstance(x, torch.Tensor) else x, batch)
    samples = next(x.shape[0] for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor))
    near = Layout(stages, o.tp, o.dp, o.data_parallel, samples // o.microbatches, o.microbatches)
    return nearest_layouts(model, *whole, near, gpus=stages * o.tp * o.dp, gpus_per_node=max(8, o.tp),
                           solves=solves, seconds=NEAREST_SECONDS, **search_options)


def _cut_by_time(planned: Plan, compiled: Callable[..., CostedPipeline], solves: Solves) -> Plan:
    """`planned`, or where its memory limit binds or its ranks differ the plan of the model cut
    where the predicted step time is least (`cut.cut_decision`), if that plan's zb-auto fits
    where the compiler's cut did not, or is faster."""
    alike = all(h == planned.rank_hardware[0] for h in planned.rank_hardware)
    if len(planned.state) < 2 or (alike and not binds(one_f_one_b_peaks(planned), planned.limits)):
        return planned
    decision = cut_decision(planned.costed, planned.rank_hardware, planned.limits, planned.options)
    if not decision.changes:
        planned.record["cut"] = decision_record(decision, "kept the compiler's cut")
        return planned
    recompiled = compiled(decision.chosen.cut.positions, planned.costed.traced)
    moved = plan_compiled(recompiled, planned.rank_hardware, planned.options, planned.microbatch, solves)
    before, after = (_zb_auto_span(p) for p in (planned, moved))
    if after < before:
        moved.record["cut"] = decision_record(decision, "moved: the step predicted on the new cut is shorter")
        return moved
    planned.record["cut"] = decision_record(decision, "kept the compiler's cut: the new cut's plan was not better")
    return planned


def _zb_auto_span(plan_: Plan) -> float:
    """zb-auto's planned span where it fits, else infinity."""
    entry = next((e for e in plan_.record["schedules"] if e["name"] == "zb-auto"), None)
    return entry["span"] if entry and not entry.get("error") and entry["fits"] else math.inf


@dataclass(frozen=True)
class PlanOptions:
    """`plan()`'s options past the compile (see there)."""

    microbatches: int
    dp: int = 1
    data_parallel: str = "replicate"
    memory_limit: float | str | None = None
    schedules: tuple[str, ...] = PLANNED_SCHEDULES
    optimizer_factor: float = 2.0
    grad_factor: float = 1.0
    time_budget: float = 1.0
    tp: int = 1


def _check_options(dp: int, data_parallel: str, tp: int = 1) -> None:
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"plan(): data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}")
    for name, value in (("dp", dp), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan(): {name} must be a positive int, got {value!r}")


def plan_compiled(
    costed: CostedPipeline,
    hardware: Hardware | str | Sequence[Hardware | str],
    options: PlanOptions,
    microbatch: str = "",
    solves: Solves | None = None,
) -> Plan:
    """The plan of a compile (`compiler.compile_costs`) on `hardware` (one for every rank, or one
    per rank): per-stage times and state, every schedule of `options.schedules` simulated; no
    compiling (`Plan.on` re-plans on other hardware). `solves`: the schedules its plan made so far
    (`pricing.Solves`), read by its menu."""
    o = options
    _check_options(o.dp, o.data_parallel)
    ranks = resolve_rank_hardware(hardware, len(costed.costs))
    limits = tuple(
        h.memory if o.memory_limit is None else (
            parse_bytes(o.memory_limit) if isinstance(o.memory_limit, str) else float(o.memory_limit)
        )
        for h in ranks
    )
    model = costed.traced.model
    shares = costed.annotation if o.tp > 1 else None
    rows = stage_rows_of(
        model.named_parameters(), costed.partition, costed.costs, shares.param_shares if shares else None
    )
    collectives = _collective_seconds(costed, ranks, shares)
    for row, cost, extra, h in zip(rows, costed.costs, collectives, ranks):
        row["state"] = state_bytes(row["held_param_bytes"], o.dp, o.data_parallel, o.grad_factor, o.optimizer_factor)
        row["seconds"] = {kind: h.pass_seconds(g, kind) + extra.get(kind, 0.0) for kind, g in pass_costs(cost).items()}
        row["tp_seconds"] = extra
    unit = float(max([c.mem_b for c in costed.costs] + [1]))
    boundary = max(costed.partition.boundary_bytes, default=0)
    message = boundary / o.tp if shares is not None and shares.sequence_parallel else boundary
    comm = max(h.link_seconds(message) for h in ranks)
    # each stage's gradient reduction over the replicas, after its last W: a ring all-reduce, or
    # under "shard" a reduce-scatter (half its bytes)
    share = 1.0 if o.data_parallel == "replicate" else 0.5
    costs = Costs(
        f=[r["seconds"]["F"] for r in rows], i=[r["seconds"]["I"] for r in rows], w=[r["seconds"]["W"] for r in rows],
        comm=comm, mem_b=[c.mem_b / unit for c in costed.costs], mem_w=[c.mem_w / unit for c in costed.costs],
        reduce=[share * h.allreduce_seconds(r["param_bytes"] * o.grad_factor, o.dp) for r, h in zip(rows, ranks)],
    )
    state = tuple(r["state"]["total"] for r in rows)
    result = Plan(costed, ranks[0], costs, unit, state, {}, {}, o, microbatch, ranks, limits)
    entries = [_plan_schedule(result, name, o.microbatches, limits, o.time_budget) for name in o.schedules]
    alike = all(h == ranks[0] for h in ranks)
    record = {
        "model": type(model).__name__,
        "stages": len(costed.costs),
        "microbatches": o.microbatches,
        "microbatch": microbatch,
        "dp": o.dp,
        "data_parallel": o.data_parallel,
        "tp": o.tp,
        "sequence_parallel": bool(shares and shares.sequence_parallel),
        "hardware": ranks[0].to_dict(),
        **({} if alike else {"rank_hardware": [h.to_dict() for h in ranks]}),
        "phase_seconds": costed.phase_seconds,
        "phase_cpu_seconds": costed.phase_cpu_seconds,
        "representative": list(costed.representative),
        "stage_rows": rows,
        "tied": {fqn: list(ks) for fqn, ks in costed.partition.shared_params.items()},
        "comm_seconds": comm,
        "memory_limit_bytes": min(limits),
        **({} if len(set(limits)) == 1 else {"memory_limits_bytes": list(limits)}),
        "allreduce_seconds": max(
            h.allreduce_seconds(r["param_bytes"] * o.grad_factor, o.dp) for r, h in zip(rows, ranks)
        ),
        "schedules": [e for e, _ in entries],
        "zb_auto": _zb_auto_choice([e for e, _ in entries], limits),
    }
    if alike:
        record.update(menu_record(costed, ranks[0], o, min(limits), solves))
    schedules = {e["name"]: s for e, s in entries if s is not None}
    return Plan(costed, ranks[0], costs, unit, state, schedules, record, o, microbatch, ranks, limits)


def _collective_seconds(
    costed: CostedPipeline, ranks: Sequence[Hardware], shares: Any
) -> list[dict[str, float]]:
    """Per stage, the seconds of one microbatch's tensor-parallel collectives in F and in I (on
    the intra-node bandwidth of the stage's rank, `ranks[stage]`); empty without tensor
    parallelism."""
    per_stage: list[dict[str, float]] = [{} for _ in costed.partition.stages]
    if shares is None:
        return per_stage
    stage_of = costed.partition.stage_of_node
    for kind, by_node in (("F", shares.forward_collectives), ("I", shares.input_collectives)):
        for node, collectives in by_node.items():
            stage = per_stage[stage_of[node]]
            hardware = ranks[stage_of[node]]
            seconds = sum(hardware.intra_node_seconds(c, nbytes, shares.tp) for c, nbytes in collectives)
            stage[kind] = stage.get(kind, 0.0) + seconds
    return per_stage


def pass_costs(cost: Any) -> dict[str, Any]:
    """A `StageGraphCost`'s F, I and W `GraphCost`s by letter (what `Hardware` times)."""
    return {"F": cost.forward, "I": cost.input_backward, "W": cost.weight_backward}


def _plan_schedule(
    plan_: Plan, name: str, microbatches: int, limits: Sequence[float], time_budget: float
) -> tuple[dict[str, Any], Schedule | None]:
    """One schedule's entry of the report, and the schedule (None where it cannot be made)."""
    stages = len(plan_.state)
    memory_limit = None
    if name == "zb-auto":
        room = [(limit - s) / plan_.unit_bytes for limit, s in zip(limits, plan_.state)]
        needs = [max(b, w) for b, w in zip(plan_.costs.mem_b, plan_.costs.mem_w)]
        short = [r for r in range(stages) if room[r] < needs[r]]
        if short:
            r = short[0]
            return {
                "name": name,
                "error": (
                    f"rank {r} has {si(max(room[r], 0) * plan_.unit_bytes, 'B')} left after its state "
                    f"({si(plan_.state[r], 'B')}), below one microbatch's activations "
                    f"({si(needs[r] * plan_.unit_bytes, 'B')})"
                    + (f"; so do ranks {', '.join(map(str, short[1:]))}" if len(short) > 1 else "")
                ),
            }, None
        memory_limit = room
    try:
        schedule, peaks = _solve_within(plan_, name, microbatches, memory_limit, limits, time_budget)
    except (ValueError, ScheduleError) as error:
        return {"name": name, "error": str(error).splitlines()[0]}, None
    sim = simulate(schedule, plan_.costs)
    fits = all(p <= limit for p, limit in zip(peaks, limits))
    entry = {
        "name": name, "peak_bytes": peaks, "fits": fits, "makespan": sim.makespan, "span": sim.span,
        "bubble_rate": sim.bubble_rate, "stage_bubble_rate": sim.stage_bubble_rate, "error": None,
        "actions": schedule.compute_only().rows_as_text(),  # what `zbcompile rehearse plan.json` runs
        # each stage's gradient reduction over the replicas (seconds, after its last W), priced in "span"
        "reduce_seconds": list(resolve_costs(plan_.costs, schedule.stages).reduce),
    }
    return entry, schedule


def _solve_within(
    plan_: Plan, name: str, microbatches: int, memory_limit: list[float] | None, limits: Sequence[float],
    time_budget: float, tries: int = 6,
) -> tuple[Schedule, list[float]]:
    """`name` made under `memory_limit` (units; a solved schedule's bound) and its peaks per rank
    in bytes with each action's transients; where those pass `limits` (bytes per rank) on a rank,
    the schedule is solved again under that rank's bound lowered by the excess and, from the
    second try on, a quarter of its stage's M_B more each time (a schedule changes by whole
    microbatches: an excess of a few bytes may take a lower bound to remove; at most `tries`
    times)."""
    mem_b = resolve_costs(plan_.costs, len(plan_.state)).mem_b
    for attempt in range(tries):
        schedule = make_schedule(
            name, len(plan_.state), microbatches, plan_.costs, memory_limit, time_budget=time_budget,
            placements=("in-line",),
        )
        peaks = plan_.peak_bytes(schedule)
        over = [max(0.0, p - limit) / plan_.unit_bytes for p, limit in zip(peaks, limits)]
        if memory_limit is None or not any(over):
            break
        memory_limit = [
            bound - excess - (0.25 * attempt * b if excess else 0.0)
            for bound, excess, b in zip(memory_limit, over, mem_b)
        ]
    return schedule, peaks


def _zb_auto_choice(entries: Sequence[dict[str, Any]], limits: float | Sequence[float]) -> dict[str, Any] | None:
    """What zb-auto would run: its schedule where it fits `limits` (bytes, per rank or for all),
    else an error saying by how much its best one passes it and what to change."""
    by_name = {e["name"]: e for e in entries}
    chosen = by_name.get("zb-auto")
    if chosen is None:
        return None
    if chosen.get("error"):
        return {"error": chosen["error"]}
    peaks = chosen["peak_bytes"]
    limits = list(limits) if isinstance(limits, (list, tuple)) else [limits] * len(peaks)
    if not chosen["fits"]:
        rank = max(range(len(peaks)), key=lambda r: peaks[r] - limits[r])
        peak, limit = peaks[rank], limits[rank]
        return {
            "error": (
                f"its best schedule peaks at {si(peak, 'B')} on rank {rank}, over the {si(limit, 'B')} per rank "
                f"by {si(peak - limit, 'B')}; plan more stages, data_parallel=\"shard\", smaller microbatches or "
                "a device with more memory"
            )
        }
    reference = by_name.get("1f1b")
    speedup = (
        reference["span"] / chosen["span"] if reference and not reference.get("error") and chosen["span"] else None
    )
    description = (
        f"zb-auto, one stage per rank, under each rank's memory left after its state; peak "
        f"{si(max(chosen['peak_bytes']), 'B')} on the fullest rank"
    )
    return {"description": description, "span": chosen["span"], "speedup_over_1f1b": speedup}


def _shapes(args: tuple, kwargs: dict) -> str:
    tensors = [*args, *kwargs.values()]
    return ", ".join(f"{tuple(t.shape)}" for t in tensors if isinstance(t, torch.Tensor)) or "(no tensors)"
