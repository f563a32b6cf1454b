"""The contest on training steps (`contest.ScheduleTrial`; the tuner's side in test_cost_tuner.py), in
one process on a logical clock: a re-solved schedule against the running one, and three of a
race's finalists: the blocks alternate, the trial stops as the race does, the least median step is
kept and the incumbent on a tie."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from zbcompile.runtime.tuning import contest
from zbcompile.runtime.tuning.contest import MIN_ROUNDS, Entrant, ScheduleTrial
from zbcompile.schedules import Costs, make_schedule

COSTS = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0])
ONE_RANK = SimpleNamespace(pp_group=None, decision_groups=())  # a pipeline of one process: no collectives


@pytest.fixture
def clock(monkeypatch):
    """A logical clock for the trial: the test advances `clock[0]`."""
    now = [0.0]
    monkeypatch.setattr(contest, "perf_counter", lambda: now[0])
    return now


def _trial(rounds: int) -> ScheduleTrial:
    running = Entrant("running", make_schedule("1f1b", 2, 4, COSTS), 10.0)
    solved = Entrant("solved", make_schedule("zb-h1", 2, 4, COSTS), 9.0)
    return ScheduleTrial([solved, running], running, rounds, {"solved": None, "running": None})


def _steps(trial: ScheduleTrial, clock, seconds_of, steps: int) -> list[str]:
    """Run `steps` steps (each lasting `seconds_of(label, step)`); the label each step ran."""
    ran = []
    for step in range(steps):
        label = trial.running.label
        ran.append(label)
        clock[0] += seconds_of(label, step)
        switched = trial.after_step(ONE_RANK)
        if trial.finished:
            break
        assert (switched is None) == (trial.running.label == label)
    return ran


def test_blocks_alternate_and_a_clear_winner_ends_the_trial_after_the_minimum_rounds(clock):
    trial = _trial(rounds=5)
    ran = _steps(trial, clock, lambda label, _: 9.0 if label == "solved" else 10.0, 100)
    assert ran == ["solved", "solved", "running", "running", "running", "running", "solved", "solved"]
    assert trial.finished and trial.rounds_run == MIN_ROUNDS and trial.winner.label == "solved"
    record = trial.record()
    assert record["chosen"] == "solved" and record["why"].startswith("faster than every other with 95% confidence")
    assert [e["measured_step_s"] for e in record["entrants"]] == [9.0, 10.0]


def test_overlapping_steps_run_every_round_and_a_tie_keeps_the_incumbent(clock):
    noise = itertools.cycle([2.0, -2.0])
    trial = _trial(rounds=4)
    _steps(trial, clock, lambda label, step: 10.0 + next(noise), 100)
    assert trial.rounds_run == 4 and trial.winner.label == "running"
    assert trial.record()["why"] == "the least median step over 4 round(s), undecided on paired rounds"


def _rounds(trial: ScheduleTrial, clock, seconds: dict[str, list[float]]) -> None:
    """Run the trial to its end, each entrant's timed step in round r lasting `seconds[label][r]`
    (its settling step 1 s)."""
    while not trial.finished:
        label = trial.running.label
        clock[0] += 1.0
        trial.after_step(ONE_RANK)
        clock[0] += seconds[label][trial.rounds_run]
        trial.after_step(ONE_RANK)


def test_undecided_after_its_rounds_the_least_median_is_kept_not_the_incumbent(clock):
    """One step's time varies by more than schedules differ: the solved schedule lost the second
    round, so no round-by-round confidence; its median is less, so it is kept all the same."""
    trial = _trial(rounds=3)
    _rounds(trial, clock, {"solved": [9.0, 10.5, 9.0], "running": [10.0, 10.0, 10.0]})
    assert trial.rounds_run == 3
    assert trial.winner.label == "solved" and "undecided" in trial.record()["why"]
    assert trial.record()["ratio_to_incumbent"]["solved"] == pytest.approx(0.9)


def test_a_steady_lead_through_the_machines_drift_decides_early(clock):
    """The machine slows down round by round (both entrants alike): the solved schedule's steps
    overlap the running one's across rounds, yet it was 5% faster within each round: decided."""
    trial = _trial(rounds=5)
    _rounds(trial, clock, {"solved": [9.5, 11.4, 13.3, 15.2, 17.1], "running": [10.0, 12.0, 14.0, 16.0, 18.0]})
    assert trial.rounds_run == MIN_ROUNDS and trial.winner.label == "solved"


def test_the_trials_end_switches_back_where_the_incumbent_won(clock):
    trial = _trial(rounds=MIN_ROUNDS)
    seen = []
    for _ in range(4 * MIN_ROUNDS):
        clock[0] += 12.0 if trial.running.label == "solved" else 10.0
        switched = trial.after_step(ONE_RANK)
        seen.append(switched.label if switched is not None else None)
        if trial.finished:
            break
    # the last block of the second round is the solved one's: its end switches back to the winner
    assert trial.finished and trial.winner.label == "running" and seen[-1] == "running"


@pytest.mark.parametrize("fastest", ["zb-auto", "zb-h2", None])
def test_three_finalists_rotate_and_the_fastest_is_kept_the_incumbent_on_a_tie(clock, fastest):
    """The race's winner runs first (the incumbent); each round runs every finalist's block in an
    order rotated round by round; `fastest` (None: all alike) wins."""
    finalists = [Entrant(label, make_schedule(label, 2, 4, COSTS), 9.0) for label in ("1f1b", "zb-auto", "zb-h2")]
    trial = ScheduleTrial(finalists, finalists[0], rounds=3)
    ran = _steps(trial, clock, lambda label, _: 9.0 if label == fastest else 10.0, 100)
    blocks = ran[::2]
    assert blocks[:3] == ["1f1b", "zb-auto", "zb-h2"] and blocks[3:6] == ["zb-auto", "zb-h2", "1f1b"], ran
    assert trial.winner.label == (fastest or "1f1b")
    assert trial.rounds_run == (MIN_ROUNDS if fastest else 3)
    assert len(trial.record()["entrants"]) == 3
