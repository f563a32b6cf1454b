"""zbcompile.checkpoint on torch.distributed.checkpoint: a run saved at 2 ranks loads with every
parameter and optimizer state equal in one process, at 2 ranks under another schedule or cut and
at 4 ranks, and across data_parallel="replicate" and "shard" at pp=2 x dp=2; resumed, it is
bitwise the uninterrupted run; a checkpoint whose writing was interrupted by a dead rank is
never taken as the latest. One 2-rank launch (`saved_run`) feeds
most of these; `test_torchrun_restart.py` kills a rank mid-step under torchrun."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy
import pytest
import torch
from torch import nn

import zbcompile
from helpers import launches
from helpers import save_resume_workers as workers
from helpers.models import build
from helpers.multiprocess import Failed, run_ranks
from zbcompile import checkpoint

# the tests of `saved_run` share an xdist group, so that `pytest -n` launches its ranks once
SAVED_RUN = pytest.mark.xdist_group("save-resume")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[str, list[dict], dict]:
    """(checkpoint directory, each rank's results, rank 0's report of the interrupted save)."""
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    survivor, victim = run_ranks(2, workers.save_resume_and_die_saving, directory, allow_failures=True)
    assert isinstance(victim, Failed), "rank 1 was to die while writing checkpoint 'b'"
    assert not isinstance(survivor, Failed), survivor.error
    per_rank = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return directory, per_rank, survivor


def _merged(per_rank: list[dict], key: str) -> dict[str, dict]:
    """The ranks' snapshots `key` merged by FQN (a tied weight is on both ranks: equal)."""
    merged: dict[str, dict] = {"params": {}, "optimizer": {}}
    for result in per_rank:
        for part in merged:
            for name, value in result[key][part].items():
                if name in merged[part] and isinstance(value, torch.Tensor):
                    assert torch.equal(merged[part][name], value), f"{key}: the ranks' copies of {name} differ"
                merged[part][name] = value
    return merged


def _assert_equal(actual: dict[str, dict], expected: dict[str, dict], what: str) -> None:
    """Every parameter and optimizer entry of `actual` is bitwise `expected`'s; every entry of
    the process's optimizer is there."""
    assert actual["params"] and actual["optimizer"], what
    for part in ("params", "optimizer"):
        for name, value in actual[part].items():
            assert name in expected[part], f"{what}: {name} was not saved"
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, expected[part][name]), f"{what}: {part} {name}"
            else:
                assert value == expected[part][name], f"{what}: {part} {name}"


@SAVED_RUN
def test_loads_at_two_ranks_under_another_schedule_and_cut(saved_run):
    directory, per_rank, _ = saved_run
    written = sorted(f for f in os.listdir(os.path.join(directory, "a")) if f.endswith(".distcp"))
    assert written == ["__0_0.distcp", "__1_0.distcp"], written  # every rank wrote its own part
    saved = _merged(per_rank, "saved")
    for r, result in enumerate(per_rank):
        _assert_equal(result["b_loaded"], saved, f"rank {r}, 1F1B")
        _assert_equal(result["c_loaded"], saved, f"rank {r}, split at {workers.OTHER_CUT}")
        assert result["b_extra"] == {"next_step": workers.SAVED_AT, "note": f"saved by rank {r}"}
        assert result["b_step_count"] == workers.SAVED_AT
    assert set(_merged(per_rank, "c_loaded")["params"]) == set(saved["params"])
    assert any(s["optimizer"] for s in (per_rank[0]["saved"], per_rank[1]["saved"]))


@SAVED_RUN
def test_the_schedule_in_use_comes_back_on_the_layout_it_ran_on(saved_run):
    """Run A's schedule in use was replaced (as measured costs do); a pipeline with A's options
    and cut runs it again after loading, with A's tuner state; another cut keeps its own."""
    _, per_rank, _ = saved_run
    for result in per_rank:
        assert result["d_static_schedule"] == "zb-auto" and result["d_schedule_restored"]
        assert result["d_tuner"] == result["saved_tuner"]
        assert result["c_schedule"] == "zb-auto"


@SAVED_RUN
def test_resumed_run_is_bitwise_the_uninterrupted_one(saved_run):
    """Run B (other init, other schedule, a process whose RNG had moved on) loads and runs the
    same 3 steps as run A after its save: dropout masks, clipping and AdamW give the same bits."""
    _, per_rank, _ = saved_run
    for r, result in enumerate(per_rank):
        _assert_equal(result["b_resumed"], result["uninterrupted"], f"rank {r}, resumed")
        saved = result["saved"]["params"]
        moved = [n for n, p in result["uninterrupted"]["params"].items() if not torch.equal(p, saved[n])]
        assert moved, "the steps after the save changed nothing"


@SAVED_RUN
def test_loads_in_one_process(saved_run):
    directory, per_rank, _ = saved_run
    pipe, opt = workers.make_run(4)
    extra = checkpoint.load(os.path.join(directory, "a"), pipe, opt)
    assert extra == {"next_step": workers.SAVED_AT, "note": "saved by rank 0"}
    assert pipe.step_count == workers.SAVED_AT
    loaded = workers.snapshot(pipe, opt)
    saved = _merged(per_rank, "saved")
    _assert_equal(loaded, saved, "one process")
    assert set(loaded["params"]) == set(saved["params"]) and set(loaded["optimizer"]) == set(saved["optimizer"])


@SAVED_RUN
def test_loads_at_four_ranks(saved_run):
    directory, per_rank, _ = saved_run
    saved = _merged(per_rank, "saved")
    four = run_ranks(4, workers.load_on_four, directory)
    for r, result in enumerate(four):
        _assert_equal(result["loaded"], saved, f"4 ranks, rank {r}")
        assert result["step_count"] == workers.SAVED_AT
        assert result["extra"]["note"] == f"saved by rank {r if r < 2 else 0}"  # ranks 2, 3: rank 0's
    assert set().union(*(r["loaded"]["params"] for r in four)) == set(saved["params"])


@SAVED_RUN
def test_a_checkpoint_interrupted_while_written_is_never_the_latest(saved_run):
    """Rank 1 was killed writing checkpoint "b": rank 0's save failed naming it (the launch
    ended: it did not hang), and "b" stays an incomplete temporary directory that `latest` skips."""
    directory, _, survivor = saved_run
    assert survivor["error"] is not None and "rank 0: checkpoint" in survivor["error"], survivor
    assert "was not completed" in survivor["error"] and "b.partial" in survivor["error"], survivor
    assert checkpoint.latest(directory) == os.path.join(directory, "a")
    assert not os.path.exists(os.path.join(directory, "b"))
    assert not os.path.exists(os.path.join(directory, "b" + checkpoint.PARTIAL, ".metadata"))
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(os.path.join(directory, "b" + checkpoint.PARTIAL), _mlp_run(0)[1])


@launches.READS_FOUR_RANKS
def test_loads_across_replicate_and_shard_at_pp2_dp2():
    """At pp=2 x dp=2 (the shared four-rank launch): what "replicate" or "shard" saved loads
    under "shard", and what "shard" saved under "replicate": every parameter and optimizer
    state bitwise the saved run's, and the 3 steps after it bitwise the uninterrupted run's."""
    per_rank = launches.four_rank_results("dp_checkpoints")
    for saved, loading in workers.DP_LOADS:
        for r, result in enumerate(per_rank):
            what = f"rank {r}: saved under {saved!r}, loaded under {loading!r}"
            _assert_equal(result[(saved, loading, "loaded")], result[(saved, "saved")], what)
            _assert_equal(result[(saved, loading, "resumed")], result[(saved, "uninterrupted")], f"{what}, resumed")
            assert result[(saved, loading, "extra")] == {"next_step": workers.SAVED_AT}, what
            assert (result[(saved, loading, "dtensors")] > 0) == (loading == "shard"), what
            moved = [
                n
                for n, p in result[(saved, "uninterrupted")]["params"].items()
                if not torch.equal(p, result[(saved, "saved")]["params"][n])
            ]
            assert moved, f"{what}: the steps after the save changed nothing"
        for part in ("params", "optimizer"):  # each pipeline rank's entries, whole
            for pp_rank in range(2):
                keys = [set(per_rank[pp_rank + 2 * d][(saved, loading, "loaded")][part]) for d in range(2)]
                assert keys[0] == keys[1] and keys[0], (saved, loading, part, pp_rank)
        merged = set().union(*(r[(saved, loading, "loaded")]["params"] for r in per_rank))
        assert merged == set(per_rank[0][(saved, "saved")]["params"]) | set(per_rank[1][(saved, "saved")]["params"])


def _mlp_run(seed: int) -> tuple[Any, Any, Any]:
    """(case, pipe, AdamW) of the zoo's MLP in one process: 2 stages, 1F1B."""
    case = build("mlp", seed)
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, schedule="1f1b")
    return case, pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)


def _step(case: Any, pipe: Any, optimizer: Any) -> None:
    case.step(pipe)
    optimizer.step()
    optimizer.zero_grad()


def test_saved_before_the_first_step_resumes_bitwise(tmp_path):
    """An optimizer that has not stepped keeps no state; saving it changes nothing and loading
    it leaves none (torch's helper would otherwise record a step of zeros)."""
    case, pipe, opt = _mlp_run(0)
    checkpoint.save(tmp_path / "start", pipe, opt)
    assert not opt.state
    _, other, other_opt = _mlp_run(1)
    assert checkpoint.load(tmp_path / "start", other, other_opt) == {}
    assert not other_opt.state and other.step_count == 0
    for run in ((pipe, opt), (other, other_opt)):
        _step(case, *run)  # the same batch
    for (name, p), q in zip(pipe.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])


def test_generators_draw_after_a_load_what_they_drew_after_the_save(tmp_path):
    """torch's, Python's and NumPy's generators are in the checkpoint: after a load (following
    draws from other seeds, as a restarted process makes) they draw what they drew after the save."""
    case, pipe, opt = _mlp_run(0)
    _step(case, pipe, opt)
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    checkpoint.save(tmp_path / "generators", pipe, opt)
    after_save = (torch.rand(4), random.random(), numpy.random.rand(4))
    torch.manual_seed(6), random.seed(6), numpy.random.seed(6)
    _, other, other_opt = _mlp_run(1)
    checkpoint.load(tmp_path / "generators", other, other_opt)
    after_load = (torch.rand(4), random.random(), numpy.random.rand(4))
    assert torch.equal(after_save[0], after_load[0])
    assert after_save[1] == after_load[1]
    assert (after_save[2] == after_load[2]).all()


def test_load_names_what_the_checkpoint_lacks(tmp_path):
    _, pipe, _ = _mlp_run(0)
    checkpoint.save(tmp_path / "model_only", pipe)
    assert checkpoint.latest(tmp_path) == str(tmp_path / "model_only")
    _, other, other_opt = _mlp_run(1)
    with pytest.raises(ValueError, match=r"lacks \d+ optimizer state \(saved without an optimizer"):
        checkpoint.load(tmp_path / "model_only", other, other_opt)
    renamed = zbcompile.pipeline(nn.Sequential(nn.Linear(6, 4)), stages=1)
    with pytest.raises(ValueError, match=r"lacks 2 entries this rank needs, e.g. \['model.0.weight'"):
        checkpoint.load(tmp_path / "model_only", renamed)
