"""The contest of measured choices (`runtime/tuning/contest.py`), in one process on a logical clock:
its entrants (zb-auto's solve, 1F1B always, the handcrafted schedules of its placement that fit
the limit), the paired decision (`leads`), when a race stops and which entrant it keeps."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from zbcompile.runtime.tuning import contest
from zbcompile.schedules import Costs, make_schedule

COSTS = Costs(f=[1.0, 1.0], i=[1.0, 1.0], w=[1.0, 1.0], mem_b=[1.0, 1.0], mem_w=[0.5, 0.5])


def _clocked(monkeypatch, seconds_of):
    """`run_step` for `race`: each step of a schedule advances a logical clock by
    `seconds_of(label, call)`; and the calls' labels in order."""
    clock, calls = [0.0], []
    monkeypatch.setattr(contest, "perf_counter", lambda: clock[0])

    def run_step(entrant):
        label = entrant.label
        calls.append(label)
        clock[0] += seconds_of(label, len(calls))

    return run_step, calls


def _field(limit=None):
    solved = make_schedule("zb-auto", 2, 4, COSTS, memory_limit=limit, time_budget=0)
    return contest.entrants(solved, COSTS, limit)


def test_entrants_are_the_solves_and_the_handcrafted_schedules_that_fit_the_limit():
    assert [e.label for e in _field()] == ["zb-auto", "1f1b", "zb-h1", "zb-h2"]
    one_f_one_b = make_schedule("1f1b", 2, 4, COSTS)
    limit = max(contest.simulate(one_f_one_b, COSTS).peak_memory)  # 1F1B's own memory
    assert [e.label for e in _field(limit)] == ["zb-auto", "1f1b", "zb-h1"]  # zb-h2 needs about twice
    assert all(e.predicted_s > 0 for e in _field())
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    skewed = Costs(f=[1.0, 3.0], i=[1.0, 3.0], w=[1.0, 3.0], mem_b=[1.0, 1.0], mem_w=[0.5, 0.5])
    static = make_schedule("zb-auto", 2, 4, skewed, time_budget=0)  # solved on other estimates
    labels = [e.label for e in contest.entrants(solved, COSTS, None, static)]
    assert labels[:2] == ["zb-auto", "zb-auto (static costs)"] and "1f1b" in labels
    assert "zb-auto (static costs)" not in [e.label for e in contest.entrants(solved, COSTS, None, solved)]
    v_costs = Costs(f=[1.0] * 4, i=[1.0] * 4, w=[1.0] * 4)
    v = make_schedule("zbv", 4, 4, v_costs, ranks=2)
    assert [e.label for e in contest.entrants(v, v_costs, None)] == ["zb-auto", "zbv"]


def test_a_pipeline_that_follows_readiness_also_races_the_solve_in_the_plans_order():
    """Moving W into waits is a prediction too: the solve runs once following readiness and once
    in the plan's order; the other entrants follow readiness, as the pipeline does."""
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    field = contest.entrants(solved, COSTS, None, readiness=True)
    assert [(e.label, e.follow_readiness) for e in field] == [
        ("zb-auto", True), ("zb-auto (plan order)", False), ("1f1b", True), ("zb-h1", True), ("zb-h2", True),
    ]
    assert field[1].schedule is solved and field[1].predicted_s == field[0].predicted_s
    fused = make_schedule("1f1b", 2, 4, COSTS)  # no W to move: nothing to race in the plan's order
    assert "zb-auto (plan order)" not in [e.label for e in contest.entrants(fused, COSTS, None, readiness=True)]
    assert not any(e.follow_readiness for e in contest.entrants(solved, COSTS, None))


def test_run_as_sets_the_runners_readiness_and_schedule():
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    field = contest.entrants(solved, COSTS, None, readiness=True)
    calls = []
    runner = SimpleNamespace(
        schedule=solved, follow=lambda flag: calls.append(("follow", flag)),
        reschedule=lambda schedule: calls.append(("reschedule", schedule.name)),
    )
    contest.run_as(runner, field[1])
    contest.run_as(runner, field[2])
    assert calls == [("follow", False), ("follow", True), ("reschedule", "1f1b")]


def test_a_clear_winner_stops_the_race_after_the_minimum_rounds(monkeypatch):
    """1F1B's steps take 10 (ms), every other 12: after MIN_ROUNDS rounds every 1F1B step beat
    every other step; each round runs every entrant twice, in an order rotated round by round."""
    field = _field()
    run_step, calls = _clocked(monkeypatch, lambda label, _: 10.0 if label == "1f1b" else 12.0)
    winner, record, finalists = contest.race(field, run_step, None, rounds=6)
    assert winner.label == "1f1b" and record["chosen"] == "1f1b"
    assert all(len(e.samples) == contest.MIN_ROUNDS for e in field)
    assert "with 95% confidence on paired rounds" in record["why"]
    turns = calls[::2]
    assert turns[:4] == ["zb-auto", "1f1b", "zb-h1", "zb-h2"] and turns[4:8] == ["1f1b", "zb-h1", "zb-h2", "zb-auto"]
    assert calls[::2] == calls[1::2]  # a settling step, then the timed one
    assert [r["measured_step_s"] for r in record["entrants"]] == [12.0, 10.0, 12.0, 12.0]
    assert finalists == [winner]  # every other is out


def test_overlapping_times_race_on_and_keep_the_least_median(monkeypatch):
    """zb-h1 is faster by its median but every timed step carries noise of +-3: the entrants the
    leader does not lead with confidence race every round, and the least median wins undecided."""
    field = _field()
    noise = itertools.cycle([3.0, -3.0])
    base = {"zb-auto": 11.0, "1f1b": 12.0, "zb-h1": 10.0, "zb-h2": 11.5}
    run_step, _ = _clocked(monkeypatch, lambda label, call: base[label] + (next(noise) if call % 2 == 0 else 0.0))
    winner, record, finalists = contest.race(field, run_step, None, rounds=5)
    assert len(winner.samples) == 5 and len(finalists) > 1
    assert winner is min(finalists, key=lambda e: e.median_s) and finalists[0] is winner
    assert "undecided" in record["why"]
    assert all(not contest.leads(winner, e) for e in finalists[1:])
    assert [e.median_s for e in finalists] == sorted(e.median_s for e in finalists)


@pytest.mark.parametrize("rounds", [0, 3])
def test_no_rounds_or_a_lone_entrant_keeps_the_solve_unraced(monkeypatch, rounds):
    field = _field()[:1] if rounds else _field()
    run_step, calls = _clocked(monkeypatch, lambda label, _: 1.0)
    winner, record, finalists = contest.race(field, run_step, None, rounds=rounds)
    assert winner.label == "zb-auto" and not calls
    assert record["entrants"][0]["measured_step_s"] is None and finalists == []


def test_an_entrant_the_leader_leads_with_confidence_runs_no_more(monkeypatch):
    """1F1B's steps (20) are far slower than the leader's (10-12) round by round: once the paired
    rounds say so with confidence it is out (its steps are kept in the record), while the others,
    overlapping, race on."""
    field = _field()
    noise = itertools.cycle([1.0, -1.0])
    base = {"zb-auto": 11.0, "1f1b": 20.0, "zb-h1": 11.2, "zb-h2": 11.4}
    run_step, calls = _clocked(monkeypatch, lambda label, call: base[label] + (next(noise) if call % 2 == 0 else 0.0))
    winner, record, finalists = contest.race(field, run_step, None, rounds=4)
    steps = {r["label"]: r["steps"] for r in record["entrants"]}
    assert contest.MIN_ROUNDS <= steps["1f1b"] < 4 and steps["zb-auto"] == 4
    assert calls.count("1f1b") == 2 * steps["1f1b"]
    assert winner.label != "1f1b" and "1f1b" not in [e.label for e in finalists]  # out: not tried again
    assert finalists[0] is winner


def _entrant(label: str, samples) -> contest.Entrant:
    solved = make_schedule("zb-auto", 2, 4, COSTS, time_budget=0)
    return contest.Entrant(label, solved, 1.0, samples=list(samples))


def test_a_lead_is_read_from_paired_rounds_not_step_against_step():
    """The machine drifts between rounds: the faster entrant's steps overlap the other's across
    rounds, yet it is faster within each round, steadily: it leads. A lead by the median that one
    round contradicts, or two rounds alone of a small gain with spread, is no lead."""
    drifting = _entrant("a", [9.5, 11.4, 13.3, 15.2, 17.1]), _entrant("b", [10.0, 12.0, 14.0, 16.0, 18.0])
    assert contest.leads(*drifting) and not contest.leads(*reversed(drifting))
    assert min(drifting[1].samples) < max(drifting[0].samples)  # step against step, they overlap
    contradicted = _entrant("a", [9.0, 10.5, 9.0]), _entrant("b", [10.0, 10.0, 10.0])
    assert not contest.leads(*contradicted)
    assert not contest.leads(_entrant("a", [9.9]), _entrant("b", [10.0]))  # one round: never
    assert not contest.leads(_entrant("a", [9.5, 10.2]), _entrant("b", [10.0, 10.0]))
    assert contest.ratios(*drifting) == [9.5 / 10.0, 11.4 / 12.0, 13.3 / 14.0, 15.2 / 16.0, 17.1 / 18.0]


def test_an_undecided_race_keeps_the_least_median_whichever_cut_it_runs_at(monkeypatch):
    """Where the rounds run out undecided, the least median step wins: a re-cut's entrant is not
    given up for the compiler's cut on a lead the noise could explain (the race has no incumbent)."""
    field = [_entrant("zb-auto", []), _entrant("zb-auto (compiler's cut)", [])]
    steps = {"zb-auto": itertools.cycle([9.0, 12.0, 9.5]), "zb-auto (compiler's cut)": itertools.cycle([10.0])}
    run_step, _ = _clocked(monkeypatch, lambda label, _: next(steps[label]))
    winner, record, finalists = contest.race(field, run_step, None, rounds=3)
    assert winner.label == "zb-auto" and "undecided" in record["why"]
    assert [e.label for e in finalists] == ["zb-auto", "zb-auto (compiler's cut)"]
