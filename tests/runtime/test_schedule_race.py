"""The schedule race of a compile (`runtime/tuning/schedule_race.py`), in one process on a logical clock:
its entrants (zb-auto's solve, 1F1B always, the handcrafted schedules of its placement that fit
the limit), when it stops, and which it keeps; and the rule by which the compile keeps another
cut than the compiler's (`calibration._moved_only_beyond_the_spread`)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from zbcompile.runtime.tuning import calibration, schedule_race
from zbcompile.schedules import Costs, make_schedule

COSTS = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0], mem_b=[1.0, 1.0], mem_w=[0.5, 0.5])


def _clocked(monkeypatch, seconds_of):
    """`run_step` for `race`: each step of a schedule advances a logical clock by
    `seconds_of(label, call)`; and the calls' labels in order."""
    clock, calls = [0.0], []
    monkeypatch.setattr(schedule_race.time, "perf_counter", lambda: clock[0])

    def run_step(entrant):
        label = entrant.label
        calls.append(label)
        clock[0] += seconds_of(label, len(calls))

    return run_step, calls


def _field(limit=None):
    solved = make_schedule("zb-auto", 2, 4, COSTS, memory_limit=limit, time_budget=0)
    return schedule_race.entrants(solved, COSTS, limit)


def test_entrants_are_the_solves_and_the_handcrafted_schedules_that_fit_the_limit():
    assert [e.label for e in _field()] == ["zb-auto", "1f1b", "zb-h1", "zb-h2"]
    one_f_one_b = make_schedule("1f1b", 2, 4, COSTS)
    limit = max(schedule_race.simulate(one_f_one_b, COSTS).peak_memory)  # 1F1B's own memory
    assert [e.label for e in _field(limit)] == ["zb-auto", "1f1b", "zb-h1"]  # zb-h2 needs about twice
    assert all(e.predicted_s > 0 for e in _field())
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    skewed = Costs(f=[1.0, 3.0], i=[1.0, 3.0], w=[1.0, 3.0], mem_b=[1.0, 1.0], mem_w=[0.5, 0.5])
    static = make_schedule("zb-auto", 2, 4, skewed, time_budget=0)  # solved on other estimates
    labels = [e.label for e in schedule_race.entrants(solved, COSTS, None, static)]
    assert labels[:2] == ["zb-auto", "zb-auto (static costs)"] and "1f1b" in labels
    assert "zb-auto (static costs)" not in [e.label for e in schedule_race.entrants(solved, COSTS, None, solved)]
    v_costs = Costs(f=[1.0] * 4, i=[1.0] * 4, w=[1.0] * 4)
    v = make_schedule("zbv", 4, 4, v_costs, ranks=2)
    assert [e.label for e in schedule_race.entrants(v, v_costs, None)] == ["zb-auto", "zbv"]


def test_a_pipeline_that_follows_readiness_also_races_the_solve_in_the_plans_order():
    """Moving W into waits is a prediction too: the solve runs once following readiness and once
    in the plan's order; the other entrants follow readiness, as the pipeline does."""
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    field = schedule_race.entrants(solved, COSTS, None, readiness=True)
    assert [(e.label, e.follow_readiness) for e in field] == [
        ("zb-auto", True), ("zb-auto (plan order)", False), ("1f1b", True), ("zb-h1", True), ("zb-h2", True),
    ]
    assert field[1].schedule is solved and field[1].predicted_s == field[0].predicted_s
    fused = make_schedule("1f1b", 2, 4, COSTS)  # no W to move: nothing to race in the plan's order
    assert "zb-auto (plan order)" not in [e.label for e in schedule_race.entrants(fused, COSTS, None, readiness=True)]
    assert not any(e.follow_readiness for e in schedule_race.entrants(solved, COSTS, None))


def test_run_as_sets_the_runners_readiness_and_schedule():
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    field = schedule_race.entrants(solved, COSTS, None, readiness=True)
    calls = []
    runner = SimpleNamespace(
        schedule=solved, follow=lambda flag: calls.append(("follow", flag)),
        reschedule=lambda schedule: calls.append(("reschedule", schedule.name)),
    )
    schedule_race.run_as(runner, field[1])
    schedule_race.run_as(runner, field[2])
    assert calls == [("follow", False), ("follow", True), ("reschedule", "1f1b")]


def test_a_clear_winner_stops_the_race_after_the_minimum_rounds(monkeypatch):
    """1F1B's steps take 10 (ms), every other 12: after MIN_ROUNDS rounds every 1F1B step beat
    every other step; each round runs every entrant twice, in an order rotated round by round."""
    field = _field()
    run_step, calls = _clocked(monkeypatch, lambda label, _: 10.0 if label == "1f1b" else 12.0)
    winner, record, finalists = schedule_race.race(field, run_step, None, rounds=6)
    assert winner.label == "1f1b" and record["chosen"] == "1f1b"
    assert all(len(e.samples) == schedule_race.MIN_ROUNDS for e in field)
    assert "beyond the spread" in record["why"]
    turns = calls[::2]
    assert turns[:4] == ["zb-auto", "1f1b", "zb-h1", "zb-h2"] and turns[4:8] == ["1f1b", "zb-h1", "zb-h2", "zb-auto"]
    assert calls[::2] == calls[1::2]  # a settling step, then the timed one
    assert [r["measured_step_s"] for r in record["entrants"]] == [12.0, 10.0, 12.0, 12.0]
    assert finalists == [winner]  # every other is out


def test_overlapping_times_run_every_round_and_keep_the_fastest_median(monkeypatch):
    """zb-h1 is faster by its median but its steps overlap the others' (noise of +-3 on every
    other step): no early stop, the fastest median wins after all rounds."""
    field = _field()
    noise = itertools.cycle([3.0, -3.0])
    base = {"zb-auto": 11.0, "1f1b": 12.0, "zb-h1": 10.0, "zb-h2": 11.5}
    run_step, _ = _clocked(monkeypatch, lambda label, call: base[label] + (next(noise) if call % 2 == 0 else 0.0))
    winner, record, finalists = schedule_race.race(field, run_step, None, rounds=5)
    assert all(len(e.samples) == 5 for e in field)
    assert winner.label == min(field, key=lambda e: e.median_s).label
    assert "beyond the spread" not in record["why"]
    assert finalists[0] is winner and [e.median_s for e in finalists] == sorted(e.median_s for e in finalists)


@pytest.mark.parametrize("rounds", [0, 3])
def test_no_rounds_or_a_lone_entrant_keeps_the_solve_unraced(monkeypatch, rounds):
    field = _field()[:1] if rounds else _field()
    run_step, calls = _clocked(monkeypatch, lambda label, _: 1.0)
    winner, record, finalists = schedule_race.race(field, run_step, None, rounds=rounds)
    assert winner.label == "zb-auto" and not calls
    assert record["entrants"][0]["measured_step_s"] is None and finalists == []


def test_an_entrant_every_step_of_which_is_slower_than_the_leaders_runs_no_more(monkeypatch):
    """1F1B's steps (20) are slower than every step of the leader (10-12): after MIN_ROUNDS rounds
    it is out (its steps are kept in the record), while the others, overlapping, race on."""
    field = _field()
    noise = itertools.cycle([1.0, -1.0])
    base = {"zb-auto": 11.0, "1f1b": 20.0, "zb-h1": 11.2, "zb-h2": 11.4}
    run_step, calls = _clocked(monkeypatch, lambda label, call: base[label] + (next(noise) if call % 2 == 0 else 0.0))
    winner, record, finalists = schedule_race.race(field, run_step, None, rounds=4)
    steps = {r["label"]: r["steps"] for r in record["entrants"]}
    assert steps == {"zb-auto": 4, "1f1b": schedule_race.MIN_ROUNDS, "zb-h1": 4, "zb-h2": 4}
    assert calls.count("1f1b") == 2 * schedule_race.MIN_ROUNDS
    assert winner.label != "1f1b" and "beyond the spread" not in record["why"]
    assert finalists[0] is winner and "1f1b" not in [e.label for e in finalists]  # out: not tried again


def test_another_cut_wins_only_by_a_lead_beyond_the_spread():
    """The race's winner at another cut than the compiler's is kept only where every one of its
    timed steps beat every one of the compiler's cut's fastest entrant; else that entrant wins,
    and the record says why. Unraced (no steps), the prediction stands."""
    compiler, other = object(), object()
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)

    def entrant(label, samples):
        return schedule_race.Entrant(label, solved, 1.0, samples=list(samples))

    home, away = entrant("zb-auto (compiler's cut)", [10.0, 10.4, 11.0]), entrant("zb-auto", [9.6, 10.2, 10.5])
    homes = {home.label: compiler, away.label: other}
    race = {"chosen": away.label, "why": "fastest measured over 3 round(s)"}
    assert calibration._moved_only_beyond_the_spread(away, [away, home], homes, compiler, race) is home
    assert race["chosen"] == home.label and "by less than their spread: the compiler's cut kept" in race["why"]
    clear = entrant("zb-auto", [8.0, 8.5, 9.0])
    assert calibration._moved_only_beyond_the_spread(clear, [clear, home], homes, compiler, dict(race)) is clear
    assert calibration._moved_only_beyond_the_spread(home, [away, home], homes, compiler, dict(race)) is home
    unraced = [entrant("zb-auto", []), entrant("zb-auto (compiler's cut)", [])]
    assert calibration._moved_only_beyond_the_spread(unraced[0], unraced, homes, compiler, dict(race)) is unraced[0]
