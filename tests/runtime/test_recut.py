"""The cut chosen again by measurement in a distributed pipeline's first compile
(`runtime/tuning/recut.py`, `runtime/tuning/calibration.py`): the parameters, gradients and buffers that change
ranks move there, and training at the new cut is bitwise training at that cut from the start
(gradients, parameters and AdamW's state after two steps), with the first step's gradients
eager's. Two ranks (one replica) and four (two replicas of two stages under "shard" and
"replicate", and one pipeline of four stages), models on the meta device and not, re-cut by a
rank slowed with the testing aid (the re-cut then races the compiler's cut on real steps, the
state moving between the cuts; whichever wins, training is bitwise that cut's) or made to
re-cut: to a V (or back to one stage per rank), trusted unraced, or to a cut whose race steps
are made slower (a sleep in each): the prediction said faster, the real steps say slower, and
the race undoes the re-cut; or, with the compiler's cut slowed too, the decision's rival (the
other placement) measured fastest and kept. The decision itself, on fixed costs, is
tests/schedules/test_cut_choice.py's."""

from __future__ import annotations

import pytest
import torch

from helpers import launches
from helpers.models import build


def _runs(launch: str) -> list[tuple[tuple, list[dict]]]:
    """Per run of the launch: its (stages, data_parallel, meta, forced) and every rank's result."""
    if launch == "two":
        per_rank, runs = launches.two_rank_results("recut"), launches.TWO_RANK_RECUTS
    else:
        per_rank, runs = launches.four_rank_results("recut"), launches.FOUR_RANK_RECUTS
    return [(run, [rank[i] for rank in per_rank]) for i, run in enumerate(runs)]


def _check_run(run: tuple, per_rank: list[dict]) -> None:
    stages, data_parallel, meta, force = run
    undone = not per_rank[0]["changed"]  # the race kept the compiler's cut
    # which cut wins a race is the real steps' say (a slowed rank's re-cut of this tiny model may lose
    # under load: its V's extra messages cost more host time than the sleep it saves); a forced one is known
    assert undone == (force == "slower") or force is None, (run, per_rank[0]["record"])
    rival = per_rank[0]["record"].get("rival") if force == "rival" else None
    assert (rival is not None) == (force == "rival"), per_rank[0]["record"]
    for rank, result in enumerate(per_rank):
        label = f"{run} rank {rank}"
        assert result["changed"] != undone, (label, result["record"])
        assert result["final_cut"] == result["reference_cut"], label  # the reference cut there from the start
        if undone:
            assert result["final_cut"] == result["static_cut"] and result["held"] == result["held_before"], label
        for part in ("first_grads", "grads", "params"):
            mine, reference = result["mine"][part], result["reference"][part]
            assert mine.keys() == reference.keys(), (label, part)
            for name in mine:
                assert torch.equal(mine[name], reference[name]), (label, part, name)
        for name, state in result["mine"]["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(value, result["reference"]["optimizer"][name][key]), (label, name, key)
        if meta:  # a rank materialised only what it holds at the final cut
            params = set(result["mine"]["params"])
            assert set(result["materialised"]) == params, label
    explained = next(r["explain"] for r in per_rank if r["explain"])
    history = per_rank[0]["history"]
    if undone:
        assert "not measured faster on real steps than the compiler's cut" in explained, explained
        assert not any(e["event"].startswith("re-cut") for e in history), history
    else:  # the state moved: some rank holds other parameters than at the compiler's cut
        assert any(r["held"] != r["held_before"] for r in per_rank), (run, per_rank[0]["cut"], explained)
        assert "cut by measurement: measured" in explained and "re-cut to" in explained, explained
        assert history and history[0]["event"].startswith("re-cut at compile"), history
    if rival is not None:  # the decision's rival measured fastest: its cut is the one kept
        assert str(per_rank[0]["cut"]) == rival["cut"] and "measured fastest on real steps" in explained, explained
        assert per_rank[0]["record"]["race"]["chosen"].endswith(f"({rival['cut']})"), explained
    _check_race(per_rank, explained, raced=force != "flip", undone=undone)
    if data_parallel == "replicate":  # replicas of one batch: every replica's gradients are eager's
        _check_eager_first_step(per_rank)


def _check_race(per_rank: list[dict], explained: str, raced: bool, undone: bool) -> None:
    """The re-cut compile raced zb-auto's solve against the handcrafted schedules of its
    placement (1F1B in-line, ZBV in a V) and against zb-auto and 1F1B (ZBV in a V) at the
    compiler's cut on real steps (`raced`), every rank keeps the winner, and explain() shows each entrant's
    predicted and measured step; `undone`: a compiler's cut entrant won."""
    race = per_rank[0]["record"]["race"]
    labels = [e["label"] for e in race["entrants"]]
    assert labels[0] == "zb-auto" and ("1f1b" in labels or "zbv" in labels), labels
    assert "zb-auto (plan order)" in labels, labels  # the pipeline follows readiness: its solve also in plan order
    if raced:
        incumbent = {"1f1b (compiler's cut)", "zbv (compiler's cut)"} & set(labels)
        assert "zb-auto (compiler's cut)" in labels and incumbent, labels
        assert all(e["steps"] >= 2 and e["measured_step_s"] > 0 for e in race["entrants"]), race
        assert race["chosen"].endswith("(compiler's cut)") == undone, race
    else:  # race_rounds=0: the prediction trusted
        assert race["chosen"] == "zb-auto" and all(e["steps"] == 0 for e in race["entrants"]), race
    running = race["chosen"].split(" (")[0]  # a label is its schedule's name, then how it differs
    assert all(r["record"]["race"]["chosen"] == race["chosen"] and r["running"] == running for r in per_rank), race
    assert f"schedule raced on real steps: kept {race['chosen']}" in explained, explained


def _check_eager_first_step(per_rank: list[dict]) -> None:
    """The first step's gradients, gathered over the ranks, are the unpipelined model's."""
    reference = build("gpt")
    reference.eager_loss().backward()
    grads = {k: v for r in per_rank for k, v in r["mine"]["first_grads"].items()}
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)


@launches.READS_TWO_RANKS
@pytest.mark.parametrize("index", range(len(launches.TWO_RANK_RECUTS)))
def test_a_recut_moves_state_between_two_ranks(index):
    run, per_rank = _runs("two")[index]
    _check_run(run, per_rank)


@launches.READS_FOUR_RANKS
@pytest.mark.parametrize("index", range(len(launches.FOUR_RANK_RECUTS)))
def test_a_recut_moves_state_between_four_ranks(index):
    run, per_rank = _runs("four")[index]
    _check_run(run, per_rank)
