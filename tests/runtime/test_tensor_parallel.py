"""Tensor parallelism inside the pipeline, with torch's DTensor plans: pp=2 x tp=2 (in the shared
four-rank launch) and dp=2 x pp=2 x tp=2 (one eight-rank launch) on the zoo GPT and a transformers
Llama: 3 AdamW steps equal eager over the whole batch under 1f1b, zb-h1, zb-auto and zbv, the same
gradients bit for bit under every schedule of one cut; each rank holds about half the parameter
bytes; the collectives of the dumped stage programs sit in F and I only; a DCP checkpoint saved at
tp=2 loads at tp=1, at pp=4 and back, bitwise; bad layouts are ValueErrors naming the mesh
dimension, the module and the sizes."""

from __future__ import annotations

import functools
import glob
import os
import re

import pytest
import torch

from helpers import launches
from helpers import tensor_parallel_workers as workers
from helpers.distributed_workers import make_optimizer

IN_LINE = ("1f1b", "zb-h1", "zb-auto")  # one cut (2 stages), besides zbv over 4


@functools.cache
def _eager_clipped() -> dict:
    """The GPT's parameters after 2 eager AdamW steps over the whole batch, clipped to norm 0.05."""
    case = workers.build("gpt")
    optimizer = make_optimizer("adamw", case.model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        case.eager_loss().backward()
        torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.05)
        optimizer.step()
    return {n: p.detach() for n, p in case.model.named_parameters()}


def _check_clipped(per_rank: list[dict]) -> None:
    """The pipeline's clipped steps equal eager's: the global norm counts every shard once."""
    merged: dict = {}
    for result in per_rank:
        merged.update(result["gpt"]["clipped"])
    expected = _eager_clipped()
    assert merged.keys() == expected.keys()
    for fqn, value in expected.items():
        torch.testing.assert_close(merged[fqn], value, **workers.CLOSE, msg=fqn)


def _check_bitwise_across_schedules(per_rank: list[dict], name: str) -> None:
    """The first step's gradients of every schedule at 1f1b's cut equal 1f1b's bitwise (zbv's cut
    in 4 stages sums a gradient's branches in another order, and zb-auto may choose another cut
    by measurement: equal to eager within rounding); zb-h1 always shares 1f1b's cut."""
    schedules = [s for s in per_rank[0][name] if s != "clipped"]
    assert set(schedules) == {*IN_LINE, "zbv"}, schedules
    first = workers.merged(per_rank, name, "1f1b", "grads")
    same_cut = [s for s in IN_LINE if per_rank[0][name][s]["cut"] == per_rank[0][name]["1f1b"]["cut"]]
    assert "zb-h1" in same_cut, same_cut
    for schedule in same_cut:
        other = workers.merged(per_rank, name, schedule, "grads")
        for fqn, grad in first.items():
            assert torch.equal(grad, other[fqn]), f"{name}: {schedule}'s gradient of {fqn} differs from 1f1b's"


# --- pp=2 x tp=2 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four():
    return launches.four_rank_results("tensor_parallel")


@launches.READS_FOUR_RANKS
def test_pp2_tp2_steps_equal_eager_over_the_whole_batch(four):
    """The GPT under every schedule and the Llama as two pipelines of its own, one after another
    (1f1b, then zb-auto), with the default options (zb-auto measures and decides on one rank for
    all, its re-cut forced, so that DTensor shards move between ranks as the re-cut races the
    compiler's cut; every schedule's Llama runs at eight ranks below),
    the GPT with sequence parallelism and the GPT built on the meta device and parallelized by
    the user: the parameters after 3 AdamW steps equal eager's; a stage's tensor-parallel ranks
    hold the same bits."""
    workers.check_equals_eager(four, ("gpt", "llama", "sp-gpt", "meta-gpt"))


@launches.READS_FOUR_RANKS
def test_pp2_tp2_gradients_bitwise_equal_across_schedules(four):
    _check_bitwise_across_schedules(four, "gpt")  # the Llama's at eight ranks


@launches.READS_FOUR_RANKS
def test_pp2_tp2_clipped_steps_equal_eager(four):
    _check_clipped(four)


def _check_explained_bytes(per_rank: list[dict]) -> None:
    """explain()'s parameters, gradients and optimizer state per rank are the bytes of the local
    shards the rank holds after the steps."""
    for result in per_rank:
        run = result["gpt"]["zb-h1"]
        assert {k: run["state_rows"][k] for k in run["bytes"]} == run["bytes"], (run["state_rows"], run["bytes"])


@launches.READS_FOUR_RANKS
def test_explain_counts_each_ranks_shards(four):
    _check_explained_bytes(four)


@launches.READS_FOUR_RANKS
def test_plan_modules_hold_dtensor_parameters_and_others_plain(four):
    dtensor = {fqn: kind for r in four for fqn, kind in r["gpt"]["zb-h1"]["dtensor"].items()}
    parallel = re.compile(r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc|proj))\.")
    assert dtensor and all(kind == bool(parallel.match(fqn)) for fqn, kind in dtensor.items()), dtensor


@launches.READS_FOUR_RANKS
def test_each_rank_holds_at_most_0_55_of_tp1s_parameter_bytes_for_the_same_stage(four):
    """The Llama with its vocabulary split too, cut at one place: a rank's parameter bytes at
    tp=2 against a rank of the same stage at tp=1; the first step's loss is eager's at both."""
    tp1 = {stage: size for r in four for stage, size, _ in [r["bytes"]["tp1"]]}
    loss, _ = workers.eager("llama")
    for result in four:
        stage, size, tp2_loss = result["bytes"]["tp2"]
        assert size <= 0.55 * tp1[stage], (stage, size, tp1[stage])
        if tp2_loss is not None:
            torch.testing.assert_close(tp2_loss, loss, **workers.CLOSE)
    assert any(r["bytes"]["tp1"][2] is not None for r in four)


@launches.READS_FOUR_RANKS
def test_dumped_collectives_are_in_f_and_i_only(four):
    """The GPT's dumped stage programs: a row-wise layer's output all-reduce in F, a column-wise
    layer's input-gradient all-reduce in I, no collective in W (deferring W defers no
    communication)."""
    dump = os.path.join(launches.directory("four-ranks"), "tensor_parallel", "dump")
    stages = sorted(glob.glob(os.path.join(dump, "*", "stage[0-9]*")))
    assert len(stages) == 2, stages
    for stage in stages:
        text = {kind: open(os.path.join(stage, f"{kind}.py")).read() for kind in ("F", "I", "W")}
        assert "_c10d_functional.all_reduce" in text["F"], stage
        assert "_c10d_functional.all_reduce" in text["I"], stage
        assert "_c10d_functional" not in text["W"], stage
        assert text["F"].count("wait_tensor(") == text["F"].count("all_reduce("), stage


@launches.READS_FOUR_RANKS
def test_checkpoint_saved_at_tp2_loads_at_tp1_at_pp4_and_back_bitwise(four):
    merged = {
        label: {
            field: {k: v for r in four for k, v in r["checkpoint"][label][field].items()}
            for field in ("params", "optimizer")
        }
        for label in ("saved", "tp1", "pp4", "back")
    }
    saved = merged["saved"]
    assert saved["params"] and saved["optimizer"]
    for label in ("tp1", "pp4", "back"):
        assert merged[label]["params"].keys() == saved["params"].keys(), label
        for fqn, value in saved["params"].items():
            assert torch.equal(merged[label]["params"][fqn], value), f"{label}: {fqn}"
        for fqn, state in saved["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(merged[label]["optimizer"][fqn][key], value), f"{label}: {fqn}.{key}"


@launches.READS_FOUR_RANKS
def test_bad_layouts_are_value_errors_naming_dimension_module_and_sizes(four):
    expected = {
        "missing module": ("'blocks.*.attn.q_proj'", "'tp'", "2 ranks"),
        "heads": ("heads=3", "'tp'", "2 ranks"),
        "hidden": ("module '0'", "(3, 6)", "dimension 0", "'tp'", "2 ranks"),
        "no tp module": ("'tp' dimension has 2 ranks", "Sequential", "tensor_parallel="),
        "pp size": ("'pp' dimension has 2 ranks", "needs 4"),
        "order": ("('tp', 'pp')", "in that order"),
        "dtensor read outside": ("module '1'", "Shard(dim=1)", "'tp'", "output_layouts=Replicate()"),
        "applied twice": ("tensor-parallel already", "'tp' mesh dimension of 2 ranks", "not both"),
    }
    for result in four:
        for label, fragments in expected.items():
            message = result["errors"][label]
            assert message is not None, label
            for fragment in fragments:
                assert fragment in message, (label, fragment, message)


# --- dp=2 x pp=2 x tp=2 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight():
    return [r["tensor_parallel"] for r in launches.eight_ranks()]


@launches.READS_EIGHT_RANKS
def test_one_rank_decides_for_every_replica_pipeline_rank_and_tensor_parallel_rank(eight):
    """The cut, a re-solved schedule and recompute levels come from `Layout.decides`' rank
    through `from_first_rank`: global rank 0 alone decides, and every rank receives its value."""
    assert [r["decided"] for r in eight] == [(True, 0)] + [(False, 0)] * 7


@launches.READS_EIGHT_RANKS
def test_dp2_pp2_tp2_steps_equal_eager_over_the_whole_batch(eight):
    """The GPT with data_parallel="shard" (parameters as DTensors over ("dp", "tp")), the Llama
    with "replicate": every replica's parameters after 3 steps equal eager's over the batch both
    replicas' halves make."""
    workers.check_equals_eager(eight, ("gpt", "llama"))
    gpt = {fqn: kind for r in eight for fqn, kind in r["gpt"]["zb-h1"]["dtensor"].items()}
    assert all(gpt.values()), gpt


@launches.READS_EIGHT_RANKS
def test_dp2_pp2_tp2_explain_counts_each_ranks_shards(eight):
    """Under "shard": the rows over "dp" of each tensor-parallel shard."""
    _check_explained_bytes(eight)


@launches.READS_EIGHT_RANKS
def test_dp2_pp2_tp2_clipped_steps_equal_eager(eight):
    """Under data_parallel="shard": gradients sharded over "dp" and "tp" at once."""
    _check_clipped(eight)


@launches.READS_EIGHT_RANKS
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_dp2_pp2_tp2_gradients_bitwise_equal_across_schedules(eight, name):
    _check_bitwise_across_schedules(eight, name)
