"""The measured-cost tuner's decisions, on a pipeline of one rank (no collectives): a first
solve after the warm-up and profiled steps, the switch once the background solver is done,
calibration, and a re-solve when the measured step drifts from the prediction; under
recompute="auto", the recompute levels chosen again with the measured costs; each solve tried on
real steps against the running schedule before it is kept."""

from __future__ import annotations

import dataclasses
import functools
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import zbcompile
from helpers.models import build
from zbcompile.inspect.decisions_text import tuner_lines
from zbcompile.inspect.write import schedule_costs_used
from zbcompile.runtime.parallel.layout import Layout
from zbcompile.runtime.tuning import contest, profile, schedule_trial
from zbcompile.runtime.tuning.auto_recompute import (
    MeasuredRecomputation,
    calibrated_costs,
    evaluate_memory,
    with_levels,
)
from zbcompile.runtime.tuning.contest import MIN_ROUNDS, Entrant
from zbcompile.schedules import Costs, make_schedule, simulate

ONE_RANK = Layout(
    pp_size=1, dp_size=1, pp_rank=0, dp_rank=0, pipeline_ranks=(0,), replica_ranks=(0,), pp_group=None,
    dp_group=None, mesh=None,
)


def _runner(schedule):
    layout = ONE_RANK
    compiled = SimpleNamespace(partition=SimpleNamespace(values={"x": torch.zeros(4)}))
    runner = SimpleNamespace(
        schedule=schedule, layout=layout, compiled=compiled, device=torch.device("cpu"), follow_readiness=True,
        transport=SimpleNamespace(timeout=timedelta(seconds=60)), timeline=[], comm_timeline=[], sizes={},
    )
    runner.follow = lambda readiness: setattr(runner, "follow_readiness", readiness)
    return runner


def _timeline(schedule, scale: float):
    """One step's timeline: every action back to back, F 1 ms, I 2 ms, W 1 ms, times `scale`."""
    seconds = {"F": 1e-3, "I": 2e-3, "W": 1e-3}
    timeline, clock = [], 0.0
    for a in sorted((a for row in schedule.actions for a in row), key=lambda a: (a.microbatch, a.stage)):
        timeline.append((str(a), clock, clock + seconds[a.kind] * scale))
        clock += seconds[a.kind] * scale
    return timeline


def _run(tuner, runner, scale: float, steps: int, reduction_s: float = 0.0) -> list:
    """`steps` steps at `scale`; with `reduction_s`, a gradient reduction posted at the last
    action's end and waited for `reduction_s` later (as the runner's comm timeline has it)."""
    switched = []
    for _ in range(steps):
        runner.timeline = _timeline(runner.schedule, scale)
        end = max(e for _, _, e in runner.timeline)
        reductions = [("REDUCE 1", end, end + reduction_s)] if reduction_s else []
        runner.comm_timeline = [("SEND_F 0 0", 0.0, 0.0), *reductions]
        new = tuner.after_step(runner)
        if new is not None:
            runner.schedule = new
            switched.append(new)
    return switched


SOLVE_WAIT_S = 120  # the background solve is a child process: slow on a loaded machine


def _wait_for_switch(tuner, runner, scale: float) -> None:
    deadline = time.monotonic() + SOLVE_WAIT_S
    while time.monotonic() < deadline:
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
    assert (measured.f, measured.i, measured.w) == (
        pytest.approx([1e-3] * 2),
        pytest.approx([2e-3] * 2),
        pytest.approx([1e-3] * 2),
    )
    _run(tuner, runner, 1.0, profile.DRIFT_WINDOW)  # the first window after the switch calibrates
    assert tuner.history[-1]["event"] == "calibrated"
    _run(tuner, runner, 1.05, profile.DRIFT_WINDOW)  # within the threshold: nothing
    assert tuner.history[-1]["event"] == "calibrated" and tuner.resolves == 1
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)  # twice as slow: drift
    assert tuner.history[-1]["event"].startswith("solving (drift +"), tuner.history
    _wait_for_switch(tuner, runner, 2.0)
    assert tuner.measured.f == pytest.approx([2e-3] * 2) and tuner.drift_resolves == 1
    # what a dump and explain() show of a schedule: the costs it was solved with, whatever was measured since
    made_with, source = schedule_costs_used(runner.schedule, None, measured)
    assert source == "measured" and made_with.f == pytest.approx([2e-3] * 2), made_with
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)  # the window has doubled: not yet calibrated
    assert tuner.history[-1]["event"] == "switched"
    _run(tuner, runner, 2.0, profile.DRIFT_WINDOW)
    assert tuner.history[-1]["event"] == "calibrated"


def test_measured_costs_count_each_stages_reduction_and_a_step_lasts_until_it_ends(monkeypatch):
    """With replicas, the measured costs carry each stage's reduction (its bytes in messages x the
    measured message time), the prediction counts it after the stage's last W, the per-action
    medians leave it out, and a reduction that slows while the actions do not is drift."""
    monkeypatch.setattr(profile, "round_trip_seconds", lambda runner: 1e-3)
    static = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0])
    schedule = make_schedule("zb-auto", 2, 4, costs=static, time_budget=0)
    runner = _runner(schedule)
    arguments = lambda costs: dict(name="zb-auto", stages=2, microbatches=4, costs=costs, time_budget=0)  # noqa: E731
    tuner = profile.CostTuner(2, arguments, static, reduction=(3.0, 5.0))
    _run(tuner, runner, 1.0, 3, reduction_s=5e-3)
    _wait_for_switch(tuner, runner, 1.0)
    measured = tuner.measured
    assert measured.reduce == pytest.approx((3e-3, 5e-3)) and measured.f == pytest.approx([1e-3] * 2)
    assert tuner.predicted_span == pytest.approx(simulate(runner.schedule, measured).span)
    assert tuner.predicted_span > simulate(runner.schedule, dataclasses.replace(measured, reduce=0.0)).span
    _run(tuner, runner, 1.0, profile.DRIFT_WINDOW, reduction_s=5e-3)
    assert tuner.history[-1]["event"] == "calibrated"
    _run(tuner, runner, 1.0, profile.DRIFT_WINDOW, reduction_s=30e-3)  # the same actions, a slower reduction
    assert tuner.history[-1]["event"].startswith("solving (drift +"), tuner.history


def test_host_time_per_action_counts_the_gaps_between_actions_but_not_the_waits_for_messages():
    timeline = [("0F0", 0.0, 1.0), ("0F1", 1.5, 2.5), ("0I0", 5.0, 6.0)]  # gaps 0.5 and 2.5
    comm = [("0SEND_F0", 1.0, 1.2), ("0RECV_B0", 3.0, 5.0)]  # 2.0 of the second gap waited for a message
    assert profile.host_seconds_per_action(timeline, comm) == pytest.approx(0.5)
    descheduled = timeline + [("0W0", 9.0, 10.0)]  # one gap of 3.0 with no message: the machine, not the runtime
    assert profile.host_seconds_per_action(descheduled, comm) == pytest.approx(0.5)
    assert profile.host_seconds_per_action([], comm) == 0.0


# --- recompute="auto" chosen again with measured costs ------------------------------------------


def _auto_recompute_gpt(limit: float = 1.5):
    """The zoo GPT in one process, recompute="auto" under `limit` (static costs choose levels
    (4, 0): stage 0 recomputes everything, W recomputing too)."""
    case = build("gpt")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, recompute="auto", memory_limit=limit
    )
    pipe.compile(*case.args, target=case.target, **case.kwargs)
    return case, pipe


def _skewed(costs: Costs, backward: tuple[float, float]) -> Costs:
    """`costs` with each stage's I and W times multiplied by its factor in `backward`."""
    return Costs(
        f=list(costs.f), i=[t * k for t, k in zip(costs.i, backward)], w=[t * k for t, k in zip(costs.w, backward)],
        mem_b=costs.mem_b, mem_w=costs.mem_w,
    )


def test_measured_recomputation_keeps_the_static_choice_for_proportional_costs_and_fits_the_limit():
    _, pipe = _auto_recompute_gpt()
    compiled = pipe.compiled
    choice = MeasuredRecomputation(compiled, pipe._builder.choice.solve_arguments)
    static = compiled.schedule_costs()
    measured = Costs(
        f=[t * 1e-9 for t in static.f], i=[t * 1e-9 for t in static.i], w=[t * 1e-9 for t in static.w], comm=1e-6
    )
    assert calibrated_costs(compiled, measured, compiled).f == measured.f  # the running levels: as measured
    levels, costs = choice.choose(measured)
    assert levels == compiled.recompute_levels and costs.i == measured.i
    levels, costs = choice.choose(_skewed(static, (20.0, 1.0)))  # stage 0's backward 20 times slower than estimated
    assert levels != compiled.recompute_levels
    evaluation = evaluate_memory(with_levels(compiled, levels), pipe._builder.choice.solve_arguments, lambda _: costs)
    assert not evaluation.over, evaluation


class _OneRank:
    """A LocalRunner seen as the tuner sees a rank's runner: the only rank of its pipeline; the
    step's timeline is set by the test."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.layout = ONE_RANK
        self.device = torch.device("cpu")
        self.transport = SimpleNamespace(timeout=timedelta(seconds=60))
        self.timeline: list = []
        self.comm_timeline: list = []
        self.sizes: dict = {}  # a compile of one shape
        self.schedule = runner.schedule

    @property
    def compiled(self):
        return self.runner.compiled

    def use_programs(self, compiled) -> None:
        self.runner.use_programs(compiled)


def test_the_tuner_chooses_recomputation_again_with_measured_costs_and_the_runner_follows():
    """Measured times with stage 0's backward 20x its estimate: the first solve chooses other
    levels, the switch runs their programs, and the gradients stay bitwise those without
    recomputation."""
    case, pipe = _auto_recompute_gpt()
    before = pipe.compiled.recompute_levels
    static = pipe.compiled.schedule_costs()
    skewed = _skewed(static, (20.0, 1.0))
    seconds = {(s, kind): getattr(skewed, kind.lower())[s] * 1e-9 for s in range(2) for kind in "FIW"}
    recompute = MeasuredRecomputation(pipe.compiled, pipe._builder.choice.solve_arguments)
    tuner = profile.CostTuner(
        2, functools.partial(pipe._builder.choice.solve_arguments, compiled=pipe.compiled), static, recompute
    )
    rank = _OneRank(pipe.runner)
    deadline = time.monotonic() + SOLVE_WAIT_S
    while time.monotonic() < deadline:
        clock, rank.timeline = 0.0, []
        for action in (a for row in rank.schedule.actions for a in row):
            rank.timeline.append((str(action), clock, clock + seconds[(action.stage, action.kind)]))
            clock += seconds[(action.stage, action.kind)]
        new = tuner.after_step(rank)
        if new is not None:
            pipe.runner.reschedule(new)
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"no switch: {tuner.history}")
    events = [e["event"] for e in tuner.history]
    assert events[-2:] == [
        f"recompute levels {list(before)} -> {list(recompute.levels)} (measured costs)",
        "switched",
    ], events
    assert recompute.levels != before and pipe.compiled.recompute_levels == recompute.levels
    assert [e.program for e in pipe.runner.executors.values()] == list(pipe.compiled.programs)
    assert tuner.static.mem_b == pipe.compiled.schedule_costs().mem_b
    pipe.zero_grad()
    case.step(pipe)
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters()}
    plain = build("gpt")
    plain_pipe = zbcompile.pipeline(plain.model, stages=2, microbatches=4, loss_fn=plain.loss_fn)
    plain_pipe.set_schedule("zb-auto").compile(*plain.args, target=plain.target)
    plain_pipe.runner.reschedule(pipe.schedule)
    plain.step(plain_pipe)
    for fqn, p in plain.model.named_parameters():
        assert torch.equal(grads[fqn], p.grad), fqn


# --- each solve tried against the running schedule before it is kept (runtime/tuning/contest.py) ---


@pytest.fixture
def clock(monkeypatch):
    """The trial's logical clock: the test advances `clock[0]`."""
    now = [0.0]
    monkeypatch.setattr(contest, "perf_counter", lambda: now[0])
    return now


def _tuner(trial_rounds: int):
    static = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0])
    schedule = make_schedule("zb-auto", 2, 4, costs=static, time_budget=0)
    arguments = lambda costs: dict(name="zb-auto", stages=2, microbatches=4, costs=costs, time_budget=0)  # noqa: E731
    return profile.CostTuner(2, arguments, static, trial_rounds=trial_rounds), _runner(schedule)


def _train(tuner, runner, clock, step_s, steps: int, scale: float = 1.0) -> None:
    """`steps` steps, each lasting `step_s(schedule)` on the trial's clock; a switch runs from the next."""
    for _ in range(steps):
        runner.timeline = _timeline(runner.schedule, scale)
        runner.comm_timeline = []
        clock[0] += step_s(runner.schedule)
        new = tuner.after_step(runner)
        if new is not None:
            runner.schedule = new


def _until_trial(tuner, runner, clock, step_s, scale: float = 1.0) -> None:
    deadline = time.monotonic() + SOLVE_WAIT_S
    while not tuner.history[-1]["event"].startswith("trying"):
        assert time.monotonic() < deadline, tuner.history
        _train(tuner, runner, clock, step_s, 1, scale)
        time.sleep(0.01)


@pytest.mark.parametrize("solved_faster", [True, False])
def test_the_tuner_keeps_a_solved_schedule_only_where_it_is_measured_faster(clock, solved_faster):
    tuner, runner = _tuner(trial_rounds=3)
    original = runner.schedule

    def step_s(schedule):  # the solved schedule carries cost_source "measured"
        solved = schedule.info.get("cost_source") == "measured"
        return 9.0 if solved == solved_faster else 10.0

    _train(tuner, runner, clock, step_s, 3)  # a warm-up and two profiled steps start the first solve
    _until_trial(tuner, runner, clock, step_s)
    assert tuner.solving and not tuner.settled and runner.schedule.info["cost_source"] == "measured"
    _train(tuner, runner, clock, step_s, 2 * 2 * MIN_ROUNDS)
    assert not tuner.solving and tuner.settled, tuner.history
    last = tuner.history[-1]
    assert last["trial"]["chosen"] == ("solved" if solved_faster else "running")
    text = "\n".join(tuner_lines(tuner.history))  # what explain() adds
    assert f"tried on real steps: kept {last['trial']['chosen']}" in text and "    solved " in text, text
    if solved_faster:
        assert last["event"] == "switched" and runner.schedule.info["cost_source"] == "measured"
    else:
        assert last["event"].startswith("kept the running schedule") and runner.schedule is original
    # not solved for again while the step keeps to the kept schedule's prediction
    _train(tuner, runner, clock, step_s, 2 * profile.DRIFT_WINDOW)
    assert tuner.resolves == 1 and tuner.history[-1]["event"] == "calibrated", tuner.history
    _train(tuner, runner, clock, step_s, profile.DRIFT_WINDOW, scale=2.0)  # twice as slow: drift, tried again
    assert tuner.history[-1]["event"].startswith("solving (drift +") and tuner.resolves == 2


def test_without_trial_rounds_the_solve_is_switched_in_untried(clock):
    tuner, runner = _tuner(trial_rounds=0)
    _train(tuner, runner, clock, lambda _: 1.0, 3)
    deadline = time.monotonic() + SOLVE_WAIT_S
    while tuner.solving:
        assert time.monotonic() < deadline, tuner.history
        _train(tuner, runner, clock, lambda _: 1.0, 1)
        time.sleep(0.01)
    assert tuner.history[-1]["event"] == "switched" and "trial" not in tuner.history[-1]


@pytest.mark.parametrize("fastest", ["zb-auto (plan order)", "zb-auto"])
def test_a_races_finalists_are_tried_on_training_steps_and_the_fastest_kept(clock, fastest):
    """`calibrated` with the race's finalists (its winner running): they alternate over the
    training's steps, each with its readiness, from the step after the warm-up; the fastest
    stays, the winner on a tie, and drift checks follow on its prediction."""
    tuner, runner = _tuner(trial_rounds=3)
    solved = runner.schedule
    h2 = make_schedule("zb-h2", 2, 4, tuner.static)
    finalists = [
        Entrant("zb-auto", solved, 1.0), Entrant("zb-auto (plan order)", solved, 1.0, follow_readiness=False),
        Entrant("zb-h2", h2, 1.0),
    ]
    tuner.calibrated(tuner.static, solved, "raced at compile: zb-auto kept", finalists)
    assert tuner.solving and not tuner.settled
    follows = []

    def step_s(schedule):
        follows.append((schedule.name, runner.follow_readiness))
        label = {"zb-h2": "zb-h2"}.get(schedule.name, "zb-auto" if runner.follow_readiness else "zb-auto (plan order)")
        return 9.0 if label == fastest else 10.0

    _train(tuner, runner, clock, step_s, 1 + 2 * 3 * MIN_ROUNDS)  # the warm-up, then MIN_ROUNDS rounds
    assert tuner.settled, tuner.history
    last = tuner.history[-1]
    assert last["trial"]["chosen"] == fastest and [e["label"] for e in last["trial"]["entrants"]] == [
        e.label for e in finalists
    ]
    event = schedule_trial.FINALIST_KEPT if fastest == "zb-auto" else schedule_trial.FINALIST_SWITCHED
    assert last["event"] == event.format(label=fastest)
    assert ("zb-h2", True) in follows and (solved.name, False) in follows  # each ran as raced
    assert runner.follow_readiness == (fastest == "zb-auto") and runner.schedule is solved
    assert tuner.history[1]["event"].startswith("trying the race's finalists on training steps")
    assert tuner.predicted_span == pytest.approx(simulate(solved, tuner.measured).span)
