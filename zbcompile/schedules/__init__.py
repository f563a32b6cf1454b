"""Pipeline schedules as data: IR, generators, the zb-auto solver, lowering, validator, simulator.

Pure Python; importing this package never imports torch (ortools and matplotlib load lazily).

    from zbcompile.schedules import Costs, make_schedule, simulate
    costs = Costs(f=18.5, i=18.1, w=9.3, comm=0.6, mem_b=1.0, mem_w=0.5)
    sched = make_schedule("zb-auto", stages=8, microbatches=24, costs=costs, memory_limit=8.0)
    res = simulate(sched, costs)   # makespan, span, bubble_rate, stage_bubble_rate, peak_memory
"""

from .costs import Costs, ResolvedCosts
from .forward_only import forward_only
from .ir import Action, ActionKind, Schedule
from .lower import lower
from .registry import (
    DEFAULT_SCHEDULE,
    REFERENCE_SCHEDULE,
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleSpec,
    check_schedule_sizes,
    make_schedule,
    pipeline_ranks,
    schedule_label,
    schedule_spec,
)
from .simulate import SimResult, simulate
from .timing import ScheduleError
from .validate import validate

__all__ = [
    "Action", "ActionKind", "Costs", "DEFAULT_SCHEDULE", "REFERENCE_SCHEDULE", "ResolvedCosts", "SCHEDULES",
    "SCHEDULE_NAMES", "Schedule", "ScheduleError", "ScheduleSpec", "SimResult", "forward_only", "lower",
    "check_schedule_sizes", "make_schedule", "pipeline_ranks", "schedule_label", "schedule_spec", "simulate",
    "validate",
]
