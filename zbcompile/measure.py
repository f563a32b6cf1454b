"""Timing training steps on a machine other jobs may share: the steady-state period of steps
run back to back, per-round paired ratios, and how much CPU other processes took meanwhile.

Pure Python (no torch). Used by `zbcompile demo` and the CPU benchmarks.

Other processes' CPU use is the machine's busy CPU time (all cores, from /proc/stat) minus the
CPU time of the processes being measured (each one's `time.process_time()`, all its threads),
over the wall time: in cores' worth, 0.5 meaning half a core was taken by someone else."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


def cpu_busy_seconds() -> float:
    """CPU seconds all cores of this machine have spent busy since boot (/proc/stat; NaN where
    there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def sleep_until(deadline: float) -> None:
    """Sleep until `time.perf_counter()` reaches `deadline` (at once when it has)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else float("nan")


@dataclass(frozen=True)
class Usage:
    """Wall seconds, this process's CPU seconds and the machine's busy CPU seconds: a reading
    (`Usage.now()`) or the difference of two (`later.since(earlier)`)."""

    wall_s: float
    own_cpu_s: float
    machine_busy_s: float

    @classmethod
    def now(cls) -> "Usage":
        return cls(time.perf_counter(), time.process_time(), cpu_busy_seconds())

    def since(self, earlier: "Usage") -> "Usage":
        return Usage(
            self.wall_s - earlier.wall_s,
            self.own_cpu_s - earlier.own_cpu_s,
            self.machine_busy_s - earlier.machine_busy_s,
        )


def others_cores(wall_s: float, machine_busy_s: float, own_cpu_s: Sequence[float]) -> float:
    """Cores' worth of CPU that processes other than those measured used during `wall_s`
    seconds: (machine busy time - the measured processes' CPU times) / wall time, at least 0
    (NaN when the machine's busy time is unknown)."""
    if wall_s <= 0:
        return float("nan")
    return max(0.0, (machine_busy_s - sum(own_cpu_s)) / wall_s)


def steady_period(step: Callable[[], None], steps: int, settle: int, sync: Callable[[], None] | None = None) -> float:
    """Seconds per step of `steps` calls of `step()` run back to back, from the end of call
    `settle` to the end of the last (the first calls still feel whatever lined the processes up,
    e.g. a barrier; a step that follows another overlaps its start with the previous one's
    tail, as every step but the first of a training run does). `sync()` runs before the first
    and after the last call (a barrier, so that every process measures the same steps)."""
    if not 0 <= settle < steps:
        raise ValueError(f"steady_period: need 0 <= settle < steps, got settle={settle}, steps={steps}")
    if sync is not None:
        sync()
    ends = [time.perf_counter()]
    for _ in range(steps):
        step()
        ends.append(time.perf_counter())
    if sync is not None:
        sync()
    return (ends[-1] - ends[settle]) / (steps - settle)


def paired_ratio(reference: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of reference's time over other's in the same round (> 1: `other` is
    faster). The machine's speed drifts between rounds; within one round both ran under the
    same conditions."""
    if len(reference) != len(other):
        raise ValueError(f"paired_ratio: {len(reference)} rounds against {len(other)}; pair the same rounds")
    return median([a / b for a, b in zip(reference, other)])
