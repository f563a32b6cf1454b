"""`PipelineOptions`: what `pipeline()` takes besides the model, each option documented once
and checked once; the runtime, the dump and checkpoints read them typed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from zbcompile.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, Costs, Schedule, check_schedule_sizes
from zbcompile.schedules.costs import EmulatedTimes
from zbcompile.schedules.memory_limit import DATA_PARALLEL_MODES, check_memory_limit

DEFAULT_TIMEOUT = timedelta(seconds=300)
STAGE_COMPILERS = ("eager", "traced", "inductor")


def check_compiler(compiler: str | None) -> None:
    if compiler is not None and compiler not in STAGE_COMPILERS:
        raise ValueError(
            f"pipeline(): unknown compiler {compiler!r}; choose one of {', '.join(STAGE_COMPILERS)} (or None: "
            "inductor on CUDA, traced elsewhere)"
        )


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """`pipeline()`'s options, each documented here once, checked when constructed (by keyword).
    `split_points` may be any sequence (kept as a tuple) and `timeout` seconds (kept as a
    timedelta). README.md tells the whole story."""

    stages: int
    microbatches: int = 1
    # (output, target) -> a microbatch's mean loss, or (loss_sum, count) for the whole batch's; None: forward returns it
    loss_fn: Callable[..., Any] | None = None
    # one of SCHEDULE_NAMES (docs/schedules.md), or a Schedule to run as given
    schedule: str | Schedule = DEFAULT_SCHEDULE
    split_points: tuple[str, ...] | None = None  # module FQNs where a stage begins; None: stages balanced by cost
    memory_limit: float | str | Sequence[float | str] | None = None
    # one pipeline's ranks, or a DeviceMesh over ("dp", "pp", "tp") or a subset; None: the world
    process_group: ProcessGroup | DeviceMesh | None = None
    timeout: timedelta = DEFAULT_TIMEOUT  # bounds every wait on a peer
    solver_time_budget: float | None = None  # seconds zb-auto improves its heuristic
    profile: bool | None = None  # measure costs and re-solve (runtime/tuning/profile.py); None: the schedule table's
    profile_steps: int = 2  # steps timed after the warm-up step before the first re-solve
    # rounds on real steps: zb-auto's first compile races its schedule, a re-cut against the compiler's cut and
    # the other placement (runtime/tuning/calibration.py), the tuner tries the race's finalists and a re-solved schedule
    # against the running one on training steps (runtime/tuning/schedule_trial.py); 0: none of these, predictions decide
    race_rounds: int = 3
    objective: str = "span"  # "span" (steps back to back) or "makespan" (a synchronisation ends every step)
    compiler: str | None = None  # "inductor" compiles each stage's graphs, "eager" runs them op by op; None: by device
    # every compile's graphs, schedule and trace (default $ZBCOMPILE_DUMP; `zbcompile inspect`)
    dump_dir: str | None = None
    init_fn: Callable[[nn.Module], None] | None = None  # fills a module's own tensors materialised from `meta`
    costs: Costs | None = None  # solve with these instead of the static estimates (any one time unit)
    follow_readiness: bool = True  # W run in waits and past sends, in order (runtime/step/dispatch.py)
    grad_dtype: torch.dtype | None = None  # dtype `.grad` accumulates in (torch's param.grad_dtype); None: as set
    # "auto": recompute forward values per stage to fit memory_limit (runtime/tuning/auto_recompute.py)
    recompute: str | None = None
    # "replicate": replicas keep parameters whole, or "shard": DTensors over "dp" (runtime/parallel/sharding.py)
    data_parallel: str = "replicate"
    # {module-FQN pattern: torch ParallelStyle}, applied on the process_group mesh's "tp" dimension
    tensor_parallel: Mapping[str, Any] | None = None
    recut: bool = True  # zb-auto measuring its costs chooses its cut again from them (runtime/tuning/recut.py)
    # symbolic sizes (runtime/compile_cache.py): None compiles once more, shape-generically, for dimensions whose
    # size changes; True: every dimension of the inputs and targets, an int or ints: those dimensions; False: per shape
    dynamic: bool | int | Sequence[int] | None = None
    # a testing aid: {global rank: factor} slows that rank's F, I, W and B by sleeping (factor - 1)
    # times each one's own time (CPU: host time), as a slower or shared device would
    _slowdown: Mapping[int, float] | None = None
    # a rehearsal and testing aid (runtime/step/action_pace.py): every F, I, W, B of stage s lasts its
    # emulated time, every message between ranks at least the link time (CPU ranks only)
    _emulate: EmulatedTimes | None = None

    @property
    def distributed(self) -> bool:
        """Whether the pipeline runs over processes: a process group given, or torch.distributed's
        default group initialised."""
        return self.process_group is not None or (dist.is_available() and dist.is_initialized())

    def __post_init__(self) -> None:
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if not isinstance(self.timeout, timedelta):
            object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))
        check_compiler(self.compiler)
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"pipeline(): data_parallel must be one of {DATA_PARALLEL_MODES}, got {self.data_parallel!r}"
            )
        if self.tensor_parallel is not None and not isinstance(self.tensor_parallel, Mapping):
            raise TypeError(
                "pipeline(): tensor_parallel must be a dict {module-FQN pattern: ParallelStyle}, e.g. "
                f"{{'layers.*.attention.wq': ColwiseParallel()}}, got {type(self.tensor_parallel).__name__}"
            )
        if self.recompute not in (None, "auto"):
            raise ValueError(f"pipeline(): recompute must be None or 'auto', got {self.recompute!r}")
        if self.recompute == "auto" and self.memory_limit is None:
            raise ValueError(
                "pipeline(): recompute='auto' chooses recomputation to fit memory_limit; give a memory_limit"
            )
        dtype = self.grad_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"pipeline(): grad_dtype must be a floating-point torch.dtype or None, got {self.grad_dtype!r}"
            )
        check_dynamic(self.dynamic)
        if self.recut not in (True, False):
            raise ValueError(f"pipeline(): recut must be True or False, got {self.recut!r}")
        for rank, factor in (self._slowdown or {}).items():
            if not isinstance(rank, int) or not isinstance(factor, (int, float)) or factor < 1:
                raise ValueError(f"pipeline(): _slowdown maps a rank (int) to a factor >= 1, got {rank!r}: {factor!r}")
        if self._emulate is not None and not isinstance(self._emulate, EmulatedTimes):
            raise TypeError(
                "pipeline(): _emulate must be a zbcompile.schedules.costs.EmulatedTimes, got "
                f"{type(self._emulate).__name__}"
            )
        if self.profile not in (None, True, False):
            raise ValueError(f"pipeline(): profile must be None (automatic), True or False, got {self.profile!r}")
        if self.costs is not None and not isinstance(self.costs, Costs):
            raise TypeError(f"pipeline(): costs must be a zbcompile.schedules.Costs, got {type(self.costs).__name__}")
        for name in ("stages", "microbatches", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pipeline(): {name} must be a positive int, got {value!r}")
        if not isinstance(self.race_rounds, int) or isinstance(self.race_rounds, bool) or self.race_rounds < 0:
            raise ValueError(f"pipeline(): race_rounds must be an int >= 0 (0: no race), got {self.race_rounds!r}")
        check_schedule_option(self.schedule, self.stages, self.microbatches)
        check_memory_limit(self.memory_limit)


def check_dynamic(dynamic: Any) -> None:
    """None, True, False, a dimension index or a sequence of them."""
    if dynamic is None or isinstance(dynamic, bool):
        return
    dims = (dynamic,) if isinstance(dynamic, int) else dynamic
    valid = isinstance(dims, Sequence) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
    if not valid:
        raise ValueError(
            "pipeline(): dynamic must be None (a dimension whose size changes compiles once more, for every size), "
            f"True, False, or the dimension indices to trace as symbols (e.g. dynamic=1), got {dynamic!r}"
        )


def check_schedule_option(schedule: Any, stages: int, microbatches: int) -> None:
    """A schedule name from the table, or a `Schedule` of `stages` stages and `microbatches`."""
    if isinstance(schedule, Schedule):
        check_schedule_sizes(schedule, stages, microbatches)
    elif not isinstance(schedule, str):
        raise TypeError(
            f"pipeline(): schedule must be a name ({', '.join(SCHEDULE_NAMES)}) or a zbcompile.schedules.Schedule "
            f"(e.g. Schedule.from_csv(text)), got {type(schedule).__name__}"
        )
    elif schedule not in SCHEDULE_NAMES:
        raise ValueError(f"pipeline(): unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
