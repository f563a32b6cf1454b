"""The measured-cost tuner's decisions, on a pipeline of one rank (no collectives): a first
solve after the warm-up and profiled steps, the switch once the background solver is done,
calibration, and a re-solve when the measured step drifts from the prediction."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from zbcompile.runtime import profile
from zbcompile.schedules import Costs, make_schedule


def _runner(schedule):
    layout = SimpleNamespace(pp_group=None, pp_rank=0, pipeline_ranks=(0,))
    compiled = SimpleNamespace(partition=SimpleNamespace(values={"x": torch.zeros(4)}))
    return SimpleNamespace(schedule=schedule, layout=layout, compiled=compiled, device=torch.device("cpu"),
                           transport=SimpleNamespace(timeout=timedelta(seconds=60)), timeline=[])


def _timeline(schedule, scale: float):
    """One step's timeline: every action back to back, F 1 ms, I 2 ms, W 1 ms, times `scale`."""
    seconds = {"F": 1e-3, "I": 2e-3, "W": 1e-3}
    timeline, clock = [], 0.0
    for a in sorted((a for row in schedule.actions for a in row), key=lambda a: (a.microbatch, a.stage)):
        timeline.append((str(a), clock, clock + seconds[a.kind] * scale))
        clock += seconds[a.kind] * scale
    return timeline


def _run(tuner, runner, scale: float, steps: int) -> list:
    switched = []
    for _ in range(steps):
        runner.timeline = _timeline(runner.schedule, scale)
        new = tuner.after_step(runner)
        if new is not None:
            runner.schedule = new
            switched.append(new)
    return switched


def _wait_for_switch(tuner, runner, scale: float) -> None:
    for _ in range(400):
        if _run(tuner, runner, scale, 1):
            return
        time.sleep(0.01)
    raise AssertionError(f"no switch: {tuner.history}")


def test_first_solve_switch_calibration_and_drift():
    static = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0])
    schedule = make_schedule("zb-auto", 2, 4, costs=static, time_budget=0)
    runner = _runner(schedule)
    arguments = lambda costs: dict(name="zb-auto", stages=2, microbatches=4, costs=costs, time_budget=0)  # noqa: E731
    tuner = profile.CostTuner(2, arguments, static)
    assert _run(tuner, runner, 1.0, 3) == []  # a warm-up step, then two profiled ones
    assert [e["event"] for e in tuner.history] == ["solving (first measurement)"] and tuner.solving
    _wait_for_switch(tuner, runner, 1.0)
    assert runner.schedule.info["cost_source"] == "measured" and not tuner.solving
    measured = tuner.measured
    assert (measured.f, measured.i, measured.w) == (pytest.approx([1e-3] * 2), pytest.approx([2e-3] * 2), pytest.approx([1e-3] * 2))
    _run(tuner, runner, 1.0, profile.DRIFT_WINDOW)  # the first window after the switch calibrates
    assert tuner.history[-1]["event"] == "calibrated"
    _run(tuner, runner, 1.05, profile.DRIFT_WINDOW)  # within the threshold: nothing
    assert tuner.history[-1]["event"] == "calibrated" and tuner.resolves == 1
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)  # twice as slow: drift
    assert tuner.history[-1]["event"].startswith("solving (drift +"), tuner.history
    _wait_for_switch(tuner, runner, 2.0)
    assert tuner.measured.f == pytest.approx([2e-3] * 2) and tuner.drift_resolves == 1
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)  # the window has doubled: not yet calibrated
    assert tuner.history[-1]["event"] == "switched"
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)
    assert tuner.history[-1]["event"] == "calibrated"
