"""The schedule table (``SCHEDULES``: every per-schedule fact lives here) and ``make_schedule``,
the one entry point for every schedule, validated before it is returned."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Sequence, Union

from .auto import zb_auto
from .building_block import v_half, v_min, v_zb
from .costs import Costs, ResolvedCosts, resolve_costs
from .dualpipe import dualpipe, dualpipev
from .handcrafted import (
    gpipe,
    in_line,
    interleaved_one_f_one_b,
    looped_bfs,
    one_f_one_b,
    round_robin,
    v_placement,
    zb_h1,
    zb_h2,
)
from .heuristic import zbv
from .ir import Schedule
from .v_choice import PLACEMENTS, choose_placement
from .validate import rank_limits, validate

OBJECTIVES = ("span", "makespan")

MemoryLimit = Union[None, float, Sequence[float]]


@dataclass(frozen=True)
class BuildRequest:
    """What a builder gets: sizes, resolved costs, per-rank memory limits (None unless the schedule
    is solved, or no limit), the objective, zb-auto's budget, interleaved-1f1b's rank count, and
    when ``make_schedule`` was called."""

    stages: int
    microbatches: int
    costs: ResolvedCosts
    limits: tuple[float, ...] | None
    objective: str
    time_budget: float | None
    deterministic: bool
    ranks: int | None
    started: float
    placements: tuple[str, ...] = ("in-line",)
    chunk_costs: ResolvedCosts | None = None  # a V result's chunks (None: ``costs.chunked(2)``)
    v_always: bool = False  # zb-auto weighs the V by time under any limit, not only below 1F1B's memory


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule's facts.

    ``build`` returns the (unvalidated) schedule. ``chunks_per_rank``: stages (chunks) each rank
    holds, so a pipeline of ``stages`` occupies ``ranks(stages)`` ranks (interleaved-1f1b may be
    given another rank count). ``solved``: built from the costs under the memory limit; the other
    schedules are fixed orders that a limit only checks. ``placement(stages)`` is stage -> rank;
    ``min_stages`` the fewest stages (chunks) it accepts. ``measures_costs``: a distributed
    pipeline left to decide (``pipeline(profile=None)``) measures its costs and re-solves the
    schedule with them, unless it was given costs. ``mirrored``: the pipeline exists twice, the
    second copy mirrored (stage s on rank ranks-1-placement(s)) for the later microbatches
    (``Schedule.mirrored_from``), so each rank runs two stages and holds both's parameters;
    ``chunks_per_rank`` counts the stages of one copy.
    """

    name: str
    build: Callable[[BuildRequest], Schedule]
    placement: Callable[[int], tuple[int, ...]] = in_line
    chunks_per_rank: int = 1
    min_stages: int = 1
    solved: bool = False
    measures_costs: bool = False
    mirrored: bool = False

    def ranks(self, stages: int) -> int:
        """Ranks one pipeline of ``stages`` stages (chunks) occupies."""
        return stages // self.chunks_per_rank


def _build_zbv(r: BuildRequest) -> Schedule:
    return zbv(r.stages, r.microbatches, r.costs, r.limits, r.objective)


def _build_zb_auto(r: BuildRequest) -> Schedule:
    def in_line() -> Schedule:
        return zb_auto(
            r.stages, r.microbatches, r.costs, r.limits, r.objective, r.time_budget, r.deterministic, r.started
        )

    return choose_placement(
        in_line, r.stages, r.microbatches, r.costs, r.limits, r.objective, r.placements, r.chunk_costs, r.v_always
    )


def _looped(stages: int) -> tuple[int, ...]:
    """Two chunks per rank, dealt out in turn (interleaved 1F1B's placement)."""
    return round_robin(stages, stages // 2)


SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ScheduleSpec("gpipe", lambda r: gpipe(r.stages, r.microbatches)),
            ScheduleSpec("1f1b", lambda r: one_f_one_b(r.stages, r.microbatches)),
            ScheduleSpec(
                "interleaved-1f1b", lambda r: interleaved_one_f_one_b(r.stages, r.microbatches, r.ranks), _looped,
                chunks_per_rank=2,
            ),
            ScheduleSpec("zb-h1", lambda r: zb_h1(r.stages, r.microbatches)),
            ScheduleSpec("zb-h2", lambda r: zb_h2(r.stages, r.microbatches)),
            ScheduleSpec("zb-auto", _build_zb_auto, solved=True, measures_costs=True),
            ScheduleSpec("zbv", _build_zbv, placement=v_placement, chunks_per_rank=2, min_stages=2, solved=True),
            *(
                ScheduleSpec(name, build, placement=v_placement, chunks_per_rank=2, min_stages=2)
                for name, build in (
                    ("v-min", lambda r: v_min(r.stages, r.microbatches)),
                    ("v-half", lambda r: v_half(r.stages, r.microbatches)),
                    ("v-zb", lambda r: v_zb(r.stages, r.microbatches)),
                )
            ),
            ScheduleSpec(
                "looped-bfs", lambda r: looped_bfs(r.stages, r.microbatches, r.ranks), _looped, chunks_per_rank=2
            ),
            ScheduleSpec(
                "dualpipev", lambda r: dualpipev(r.stages, r.microbatches), v_placement, chunks_per_rank=2, min_stages=2
            ),
            ScheduleSpec("dualpipe", lambda r: dualpipe(r.stages, r.microbatches), min_stages=2, mirrored=True),
        )
    }
)
SCHEDULE_NAMES = tuple(SCHEDULES)
DEFAULT_SCHEDULE = "zb-auto"
REFERENCE_SCHEDULE = "1f1b"  # what the default is compared with (the demo, benchmarks)


def schedule_spec(name: str) -> ScheduleSpec:
    """The table entry of ``name``; ValueError naming the choices when there is none."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return SCHEDULES[name]


def _check_sizes(spec: ScheduleSpec, stages: int, microbatches: int) -> None:
    for label, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{spec.name}: {label} must be a positive int, got {value!r}")
    if stages < spec.min_stages:
        raise ValueError(
            f"{spec.name} needs at least {spec.min_stages} stages ({spec.chunks_per_rank} chunks per rank), got "
            f"{stages}"
        )


def pipeline_ranks(schedule: str | Schedule, stages: int) -> int:
    """Ranks one pipeline of ``stages`` stages occupies under ``schedule`` (a name, or a given
    ``Schedule``: its own rank count)."""
    return schedule.ranks if isinstance(schedule, Schedule) else schedule_spec(schedule).ranks(stages)


def schedule_label(schedule: str | Schedule) -> str:
    """How messages name ``schedule``: its name, or a given Schedule's name and shape."""
    if isinstance(schedule, Schedule):
        return (
            f"{schedule.name!r} (a Schedule of {schedule.stages} stages, {schedule.microbatches} "
            f"microbatches on {schedule.ranks} ranks)"
        )
    return repr(schedule)


def check_schedule_sizes(schedule: Schedule, stages: int, microbatches: int, what: str = "the pipeline") -> None:
    """ValueError unless the given ``schedule`` runs ``stages`` stages and ``microbatches``
    microbatches, and every one of its ranks runs a stage."""
    label = schedule_label(schedule)
    if schedule.stages != stages:
        raise ValueError(
            f"schedule {label} runs {schedule.stages} stages (chunks), but {what} has {stages}; "
            f"pass stages={schedule.stages} to pipeline(), or a schedule of {stages} stages"
        )
    if schedule.microbatches != microbatches:
        raise ValueError(
            f"schedule {label} runs {schedule.microbatches} microbatches, but {what} splits the batch in "
            f"{microbatches}; pass microbatches={schedule.microbatches} to pipeline(), or a schedule of {microbatches}"
        )
    idle = [r for r in range(schedule.ranks) if not schedule.stages_on(r)]
    if idle:
        raise ValueError(f"schedule {label}: ranks {idle} run no stage; every rank of a pipeline must run one")


def _given(
    schedule: Schedule, stages: int, microbatches: int, costs, memory_limit: MemoryLimit, check: bool
) -> Schedule:
    """A schedule given as such: checked against the sizes and, with ``check``, validated under
    the costs and the limit (a fixed order, which a limit only checks)."""
    check_schedule_sizes(schedule, stages, microbatches)
    if check:
        try:
            validate(schedule, resolve_costs(costs, stages), memory_limit)
        except ValueError as error:
            raise type(error)(f"schedule {schedule_label(schedule)} cannot run: {error}") from None
    return schedule


def make_schedule(
    name: str | Schedule, stages: int, microbatches: int, costs: Costs | ResolvedCosts | None = None,
    memory_limit: MemoryLimit = None, objective: str = "span",
    *, time_budget: float | None = None, ranks: int | None = None, deterministic: bool = False, check: bool = True,
    placements: Sequence[str] = PLACEMENTS, chunk_costs: Costs | ResolvedCosts | None = None, v_always: bool = False,
) -> Schedule:
    """Build, validate and return the schedule ``name`` (one of ``SCHEDULE_NAMES``). ``name`` may
    also be a ``Schedule`` (e.g. ``Schedule.from_csv(text)``): it is checked against ``stages``,
    ``microbatches``, ``costs`` and ``memory_limit`` and returned as it is.

    ``stages`` counts chunks for multi-chunk schedules ("interleaved-1f1b", "looped-bfs": ``ranks``
    ranks, default two chunks each; "zbv", "v-min", "v-half", "v-zb", "dualpipev": two chunks per
    rank in a V) and costs are then per chunk. "dualpipe" runs ``stages`` stages on as many ranks, twice:
    stage s on rank s for the first half of the microbatches, on rank stages-1-s for the others.
    ``memory_limit`` (units of ``mem_b``; scalar or one per rank) binds the solved schedules
    (zb-auto, zbv) and is checked for every schedule. zb-auto spends up to ``time_budget`` seconds
    (default 3) improving its heuristic with the exact solver; ``time_budget=0`` returns the
    heuristic. ``objective``: "span" (steps back to back; the paper's) or "makespan" (a barrier
    per step). ``placements`` (zb-auto; default both of ``v_choice.PLACEMENTS``): with "v" among
    them and a limit below 1F1B's, zb-auto may return a V schedule of 2 x ``stages`` chunks on
    ``stages`` ranks (``v_choice.choose_placement``; check ``sched.stages``); ``("in-line",)``
    keeps one stage per rank, the stages the caller compiled.
    ``chunk_costs``: the costs of those 2 x ``stages`` chunks where the caller compiled them
    (default: ``costs`` cut in two, ``ResolvedCosts.chunked``). ``v_always``: zb-auto weighs the V
    against one stage per rank by the objective under any limit, or none (a pipeline's default).
    """
    if isinstance(name, Schedule):
        return _given(name, stages, microbatches, costs, memory_limit, check)
    spec = schedule_spec(name)
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use 'span' or 'makespan'")
    _check_sizes(spec, stages, microbatches)
    sc = resolve_costs(costs, stages)
    started = time.perf_counter()
    limits = rank_limits(memory_limit, spec.ranks(stages)) if spec.solved else None
    chunks = None if chunk_costs is None else resolve_costs(chunk_costs, 2 * stages)
    request = BuildRequest(
        stages, microbatches, sc, limits, objective, time_budget, deterministic, ranks, started, tuple(placements),
        chunks, v_always,
    )
    sched = spec.build(request)
    sched = sched.with_info(solve_time_s=time.perf_counter() - started)
    if sched.stages != stages:  # zb-auto chose two chunks per rank: per-chunk costs
        sc = chunks or sc.chunked(sched.stages // stages)
    if check:
        # a schedule that chose its own limit (zbv without one: 1F1B's memory) records it in info
        validate(sched, sc, sched.info.get("memory_limit", memory_limit))
    return sched
