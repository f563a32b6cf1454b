"""`zbcompile rehearse`: a pipeline run at a scale this machine cannot compute, rehearsed with its
real runtime. p local gloo processes run a small stand-in model of as many stages (chunks) as
each schedule needs, every F, I, W and B of stage s taking exactly the given time and every
message between ranks at least the given link time (`runtime/step/action_pace.py`; the stand-in's own
work is a few microseconds inside each action). So the ranks mostly wait, and 8-32 of them fit on
a few cores; what remains is what the runtime itself does: the order it posts messages in,
readiness, the host time of each action, the messages a V adds.

The times come from a `Costs` (any unit; `unit_s` seconds each), from the paper's Table 9
(`paper_times`), or from a `zbcompile plan` record (`plan_times`). Each schedule runs `steps`
steps back to back per round, rounds interleaved; torch.distributed.pipelining's schedules can
run beside them under the same times (`rehearsal/torch_schedules.py`). What comes back
(`rehearsal/report.py`): per schedule the measured steady step, both bubble rates, the
simulator's prediction for the same times, the host time per action, and the timelines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zbcompile import measure
from zbcompile.rehearsal.torch_schedules import TORCH_SCHEDULES, TorchRun, mse
from zbcompile.runtime.parallel.local_ranks import run_ranks
from zbcompile.schedules import Costs, Schedule, make_schedule, schedule_spec
from zbcompile.schedules.costs import EmulatedTimes, ResolvedCosts, resolve_costs

# The paper's Table 9 (ms per microbatch on A100 80GB): pipeline ranks, T_F, T_B (our I), T_W,
# T_comm, and the microbatch counts of Tables 4 and 5.
PAPER_TIMES: Mapping[str, tuple[int, float, float, float, float, tuple[int, ...]]] = {
    "1.5B": (8, 18.522, 18.086, 9.337, 0.601, (24, 32, 64)),
    "6.2B": (8, 29.718, 29.444, 19.927, 0.527, (24, 32, 64)),
    "14.6B": (16, 11.347, 11.248, 8.132, 0.377, (48, 64, 128)),
    "28.3B": (32, 10.419, 10.207, 7.715, 0.408, (96, 128, 256)),
}
# The paper's Table 4 at the smallest m: throughput of ZB-2p and ZB-1p over 1F1B's.
PAPER_GAINS: Mapping[str, tuple[float, float]] = {
    "1.5B": (14.5 / 11.8, 12.9 / 11.8),
    "6.2B": (4.32 / 3.50, 3.88 / 3.50),
    "14.6B": (1.81 / 1.40, 1.61 / 1.40),
    "28.3B": (0.99 / 0.76, 0.87 / 0.76),
}
# zb-auto under the paper's memory limits: 1F1B's activation memory (p microbatches' on the
# first rank) and twice that, in-line, as the paper's ZB-1p and ZB-2p.
MEMORY_NAMED = {"zb-1p": 1, "zb-2p": 2}
OURS = ("1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p")
# a plan rehearsed at its own times where its mean action lasts this long (seconds), else scaled into it
PLAN_ACTION_S = (0.012, 0.03)


@dataclass(frozen=True)
class Prepared:
    """One of our schedules as it will run: the schedule, its per-stage (chunk) costs, and what
    the simulator predicts for them."""

    name: str
    schedule: Schedule
    costs: ResolvedCosts
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rehearsal:
    """What to rehearse: `ranks` pipeline ranks, `microbatches`, `costs` per stage (one stage per
    rank; a V's chunks take half each) in units of `unit_s` seconds, our `schedules` (registry
    names, or "zb-1p"/"zb-2p") and torch's (`torch_schedules`, class names of
    torch.distributed.pipelining). Each runs `warmup` steps, then per round `steps` steps back to
    back (the first `settle` not timed), `rounds` rounds in alternating order."""

    ranks: int
    microbatches: int
    costs: Costs | ResolvedCosts
    unit_s: float = 1e-3
    schedules: tuple[str, ...] = OURS
    torch_schedules: tuple[str, ...] = ()
    given: tuple[Prepared, ...] = ()  # schedules given as they are (a plan's), run beside `schedules`
    steps: int = 5
    settle: int = 1
    rounds: int = 2
    warmup: int = 2
    width: int = 8
    timeout_s: float = 600.0
    label: str = ""

    def __post_init__(self) -> None:
        if self.ranks < 2 or self.microbatches < 1:
            raise ValueError(
                f"rehearse: needs at least 2 ranks and 1 microbatch, got {self.ranks} and {self.microbatches}"
            )
        if self.steps <= self.settle:
            raise ValueError(f"rehearse: steps ({self.steps}) must exceed the untimed settle steps ({self.settle})")
        for name in self.schedules:
            if name not in MEMORY_NAMED:
                schedule_spec(name)  # ValueError naming the choices
        for name in self.torch_schedules:
            if name not in TORCH_SCHEDULES:
                choices = ", ".join(TORCH_SCHEDULES)
                raise ValueError(f"rehearse: no torch schedule {name!r} to rehearse; choose one of {choices}")


def paper_times(model: str, microbatches: int | None = None, time_scale: float = 1.0, **options: Any) -> Rehearsal:
    """The paper's setting `model` ("1.5B", "6.2B", "14.6B", "28.3B"): its ranks and Table 9's
    times in ms, each `time_scale` times as long (the bubble rates and gains stay the simulator's;
    the runtime's own time per action weighs less: what many processes sharing few cores need),
    at `microbatches` (default the smallest of the paper's)."""
    if model not in PAPER_TIMES:
        raise ValueError(f"rehearse: the paper has no setting {model!r}; choose one of {', '.join(PAPER_TIMES)}")
    ranks, f, i, w, comm, counts = PAPER_TIMES[model]
    m = counts[0] if microbatches is None else microbatches
    label = f"{model}, m={m}" + (f", times x{time_scale:g}" if time_scale != 1 else "")
    return Rehearsal(ranks, m, Costs(f=f, i=i, w=w, comm=comm), unit_s=1e-3 * time_scale, label=label, **options)


def plan_time_scale(record: Mapping[str, Any], window: tuple[float, float] = PLAN_ACTION_S) -> float:
    """The time scale `zbcompile rehearse plan.json` runs a plan at unless told: 1 where the mean
    of its stages' F, I and W seconds lies in `window`, else the scale (two significant digits)
    that brings it to the window's middle. Every time scales alike, so the predicted bubbles and
    orderings stay; what it sets is the share of the runtime's own host time per action (0.1-0.3
    ms, more where the ranks share few cores) and how long the rehearsal takes."""
    rows = record["stage_rows"]
    mean = sum(r["seconds"][k] for r in rows for k in "FIW") / (3 * len(rows))
    if mean <= 0 or window[0] <= mean <= window[1]:
        return 1.0
    return float(f"{sum(window) / 2 / mean:.2g}")


def plan_times(record: Mapping[str, Any], time_scale: float = 1.0, **options: Any) -> Rehearsal:
    """A `zbcompile plan` record's pipeline and the schedules it made, as they are: its stages'
    predicted F, I and W seconds, its message time and, with replicas, each stage's gradient
    reduction (run by emulated replicas, `runtime/step/action_pace.EmulatedReduction`), each
    `time_scale` times as long (a 70B-class step of many seconds rehearsed at a tenth); a V's
    chunks take half a stage's time; the menu's choice (its recomputation and chunks) runs on its
    own times, as "menu: ..."; `schedules` (an option) picks some of the plan's by name ("menu":
    the menu's choice). Each schedule keeps the plan's predicted step (`extra["plan_s"]`) and
    what the plan priced that the rehearsal leaves out (`extra["left_out"]`: the reduction where
    the record predates its per-stage times)."""
    rows = record["stage_rows"]
    stages = len(rows)
    per_stage = resolve_costs(
        Costs(
            f=[r["seconds"]["F"] for r in rows], i=[r["seconds"]["I"] for r in rows],
            w=[r["seconds"]["W"] for r in rows], comm=float(record["comm_seconds"]),
        ),
        stages,
    )
    wanted = options.pop("schedules", None)
    given = []
    for entry in record["schedules"]:
        if entry.get("actions") and (wanted is None or entry["name"] in wanted):
            schedule = Schedule.from_rows(entry["actions"], entry["name"], microbatches=record["microbatches"])
            costs = per_stage if schedule.stages == stages else per_stage.chunked(schedule.stages // stages)
            costs, extra = _with_plan_reduction(record, costs, entry.get("reduce_seconds"))
            given.append(Prepared(entry["name"], schedule, costs, {"plan_s": entry["span"] * time_scale, **extra}))
    choice = record.get("menu_choice")
    if choice and choice.get("actions") and (wanted is None or "menu" in wanted):
        name = f"menu: {choice['schedule']}"
        schedule = Schedule.from_rows(choice["actions"], name, microbatches=record["microbatches"])
        seconds = choice["seconds"]
        costs = Costs(f=seconds["f"], i=seconds["i"], w=seconds["w"], comm=seconds["comm"]).resolve(schedule.stages)
        costs, extra = _with_plan_reduction(record, costs, seconds.get("reduce"))
        given.append(Prepared(name, schedule, costs, {"plan_s": choice["step"] * time_scale,
                                                     "recompute": choice["recompute"], **extra}))
    if not given:
        raise ValueError(f"rehearse: the plan record has no schedule {'of ' + ', '.join(wanted) if wanted else ''} "
                         "to rehearse (a record of `zbcompile plan --json` lists each schedule's actions)")
    label = f"{record.get('model', 'plan')}, pp={stages}, m={record['microbatches']}, times x{time_scale:g}"
    if record.get("dp", 1) > 1:
        label += f", dp={record['dp']} ({record.get('data_parallel', 'replicate')}) emulated"
    return Rehearsal(
        stages, int(record["microbatches"]), per_stage, unit_s=time_scale, label=label, schedules=(),
        given=tuple(given), **options,
    )


def _with_plan_reduction(
    record: Mapping[str, Any], costs: ResolvedCosts, reduce: Sequence[float] | None
) -> tuple[ResolvedCosts, dict[str, Any]]:
    """`costs` with the plan's per-stage (chunk) reduction seconds `reduce` where the record has
    them; else, where the plan had replicas, unchanged and the reduction named as left out."""
    if reduce is not None:
        return replace(costs, reduce=resolve_costs(Costs(reduce=list(reduce)), costs.stages).reduce), {}
    if record.get("dp", 1) > 1:
        return costs, {"left_out": ["the gradient reduction (the record predates its per-stage times)"]}
    return costs, {}


def prepare(settings: Rehearsal) -> list[Prepared]:
    """Our schedules built for the settings' times (a V's chunks at half a stage's time each)."""
    per_stage = resolve_costs(settings.costs, settings.ranks)
    prepared = []
    for name in settings.schedules:
        if name in MEMORY_NAMED:
            limit = MEMORY_NAMED[name] * settings.ranks * max(per_stage.mem_b)
            schedule = make_schedule(
                "zb-auto", settings.ranks, settings.microbatches, per_stage, memory_limit=limit, placements=("in-line",)
            )
        else:
            stages = settings.ranks * schedule_spec(name).chunks_per_rank
            costs = per_stage if stages == settings.ranks else per_stage.chunked(stages // settings.ranks)
            schedule = make_schedule(name, stages, settings.microbatches, costs, ranks=settings.ranks)
        chunks = schedule.stages // settings.ranks
        costs = per_stage if chunks == 1 else per_stage.chunked(chunks)
        prepared.append(Prepared(name, schedule, costs))
    return [*prepared, *settings.given]


# --- the stand-in and one rank's rehearsal -----------------------------------------------------


class StandIn(nn.Module):
    """`chunks` tiny layers, one per stage: the work of each action is a few small matmuls (the
    emulated times stand for the real ones)."""

    def __init__(self, chunks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def standin_batch(settings: Rehearsal, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per microbatch, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    shape = (settings.microbatches, width)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


class _OurRun:
    """One of our schedules on this rank, under the emulated times."""

    def __init__(self, settings: Rehearsal, prepared: Prepared) -> None:
        import zbcompile

        torch.manual_seed(0)
        chunks = prepared.schedule.stages
        self.pipe = zbcompile.pipeline(
            StandIn(chunks, settings.width), stages=chunks, microbatches=settings.microbatches,
            schedule=prepared.schedule, split_points=[f"layers.{c}" for c in range(1, chunks)], loss_fn=mse,
            profile=False, race_rounds=0, recut=False, timeout=settings.timeout_s,
            _emulate=EmulatedTimes(prepared.costs, settings.unit_s),
        )
        self.inputs, self.targets = standin_batch(settings, settings.width)
        self.pipe.compile(self.inputs, target=self.targets)

    def step(self) -> None:
        self.pipe.step(self.inputs, target=self.targets)

    def timeline(self) -> dict[str, list]:
        return {"compute": list(self.pipe.runner.timeline), "comm": list(self.pipe.runner.comm_timeline)}


def _rank_main(settings: Rehearsal, prepared: Sequence[Prepared]) -> dict[str, Any]:
    runs: dict[str, Any] = {p.name: _OurRun(settings, p) for p in prepared}
    per_stage = resolve_costs(settings.costs, settings.ranks)
    for name in settings.torch_schedules:
        runs[f"torch {name}"] = TorchRun(name, per_stage, settings.unit_s, settings.microbatches, settings.width)
    for run in runs.values():
        for _ in range(settings.warmup):
            run.step()
    periods: dict[str, list[float]] = {key: [] for key in runs}
    timelines: dict[str, list] = {key: [] for key in runs}
    for r in range(settings.rounds):
        for key in runs if r % 2 == 0 else reversed(list(runs)):
            run = runs[key]
            periods[key].append(measure.steady_period(run.step, settings.steps, settings.settle, dist.barrier))
            if isinstance(run, _OurRun):  # its last step's
                timelines[key].append(run.timeline())
    dist.barrier()
    return {"periods": periods, "timelines": timelines}


def rehearse(settings: Rehearsal) -> dict[str, Any]:
    """Run the rehearsal on `settings.ranks` local processes; its record
    (`rehearsal/report.analyse` over every rank's measurements)."""
    from zbcompile.rehearsal.report import analyse

    started = time.perf_counter()
    prepared = prepare(settings)
    prepared_s = time.perf_counter() - started
    per_rank = run_ranks(settings.ranks, _rank_main, settings, prepared, timeout_s=settings.timeout_s)
    record = analyse(settings, prepared, per_rank)
    record["seconds"] = {"prepare": prepared_s, "total": time.perf_counter() - started}
    return record

