"""Data parallelism on 4 gloo ranks, 2 replicas x a 2-rank pipeline, each replica given its own
half of the batch (DDP's convention): "replicate" and "shard" (DTensors over "dp") under in-line,
V and mirrored schedules, a zoo model and a transformers Llama, 3 AdamW steps against eager over
the whole batch; the gradient reduction overlapped with the step and counted by zb-auto;
explain()'s bytes against the tensors'; grad_dtype under "shard"; post-validation, checkpoints
and errors. All of it in the shared four-rank launch (`helpers/launches.py`)."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from helpers import data_parallel_workers as workers
from helpers import launches, models, real_models
from helpers.distributed_workers import eager_adamw
from zbcompile.inspect.read import SCHEDULE_FILE
from zbcompile.inspect.text import si
from zbcompile.inspect.timelines import action_events, load_trace, reduction_events, validate_trace
from zbcompile.schedules import Action

pytestmark = launches.READS_FOUR_RANKS

RUNS = workers.RUNS

CLOSE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def per_rank():
    """Every rank's results of `RUNS` and of the checks after them, from the shared four-rank launch."""
    return launches.four_rank_results("data_parallel")


@functools.cache
def _eager(name: str) -> tuple[list[torch.Tensor], dict, dict]:
    """The first step's loss, then the parameters and AdamW state after `STEPS` eager steps over
    the whole batch."""
    case = real_models.build(name) if name in real_models.MODELS else models.build(name)
    losses, optimizer = eager_adamw(case, workers.STEPS)
    params = dict(case.model.named_parameters())
    state = {n: optimizer.state[p] for n, p in params.items()}
    return losses, {n: p.detach() for n, p in params.items()}, state


def _replica(per_rank: list[dict], key: tuple, replica: int, field: str | None) -> dict:
    """`field` of result `key` (the result itself where `field` is None) merged over the ranks of `replica`."""
    merged = {}
    for result in per_rank[replica * workers.PP : (replica + 1) * workers.PP]:
        merged.update(result[key] if field is None else result[key][field])
    return merged


def test_every_run_equals_eager_over_the_whole_batch(per_rank):
    """Gathered parameters and AdamW state after 3 steps equal eager's over the concatenated
    batch; both replicas hold the same bits; each replica's loss is its half's."""
    for key in RUNS:
        losses, params, state = _eager(key[0])
        replica_losses = [r[key]["losses"] for r in per_rank if r[key]["losses"][0] is not None]
        assert len(replica_losses) == 2, key  # one per replica
        torch.testing.assert_close((replica_losses[0][0] + replica_losses[1][0]) / 2, losses[0], **CLOSE)
        for field in ("params", "optimizer"):
            first, second = _replica(per_rank, key, 0, field), _replica(per_rank, key, 1, field)
            assert first.keys() == params.keys(), (key, field)
            for fqn in params:
                if field == "params":
                    assert torch.equal(first[fqn], second[fqn]), f"{key}: replicas differ on {fqn}"
                    torch.testing.assert_close(first[fqn], params[fqn], **CLOSE, msg=f"{key} {fqn}")
                    continue
                for k, v in state[fqn].items():
                    assert torch.equal(first[fqn][k], second[fqn][k]), f"{key}: replicas differ on {fqn}.{k}"
                    torch.testing.assert_close(first[fqn][k], v, **CLOSE, msg=f"{key} {fqn}.{k}")


def test_every_replica_starts_from_replica_zeros_parameters(per_rank):
    """Replica 1's model is perturbed before each compile; after it, every rank holds the
    model's initial parameters (replica 0's) bitwise: the compile broadcasts them."""
    compiles = [k for k in per_rank[0] if k[0] == "compiled"]
    assert {k[1:] for k in compiles} == {(name, stages, mode) for name, _, stages, mode, _ in RUNS}
    for key in compiles:
        name = key[1]
        case = real_models.build(name) if name in real_models.MODELS else models.build(name)
        initial = {n: p.detach() for n, p in case.model.named_parameters()}
        for replica in (0, 1):
            held = _replica(per_rank, key, replica, None)
            assert held.keys() == initial.keys(), (key, replica)
            for fqn, value in initial.items():
                assert torch.equal(held[fqn], value), f"{key} replica {replica}: {fqn}"


def test_shard_equals_replicate_bitwise(per_rank):
    """The same schedule and optimizer, gradients reduce-scattered instead of all-reduced: with
    two replicas every element is the same sum (a + b), so the same bits."""
    pairs = [(k, (*k[:3], "shard", k[4])) for k in RUNS if k[3] == "replicate"]
    assert len(pairs) == 9
    for replicate, shard in pairs:
        for result in per_rank:
            for fqn, value in result[replicate]["params"].items():
                assert torch.equal(value, result[shard]["params"][fqn]), f"{shard}: {fqn}"


def test_shard_holds_dtensors_and_at_most_0_55_of_replicate_bytes(per_rank):
    for result in per_rank:
        replicate, shard = (
            result[("gpt", "zb-h1", 2, "replicate", "foreach")],
            result[("gpt", "zb-h1", 2, "shard", "foreach")],
        )
        assert all(shard["dtensor"].values()) and not any(replicate["dtensor"].values())
        assert set(shard["state_dict"].values()) == {"DTensor"}, shard["state_dict"]
        total = {label: sum(run["bytes"].values()) for label, run in (("replicate", replicate), ("shard", shard))}
        assert 0 < total["shard"] <= 0.55 * total["replicate"], total
        assert "data_parallel='shard' over 2 replicas" in shard["explain"], shard["explain"]


def test_explain_counts_the_bytes_each_rank_holds(per_rank):
    """explain()'s parameters, gradients and optimizer state per rank are the bytes of the
    tensors the rank holds after the steps (whole under "replicate", its DTensor shards under
    "shard"; every leading dimension of this model divides by 2), and it prints them."""
    for mode in ("replicate", "shard"):
        for rank, result in enumerate(per_rank):
            run = result[("gpt", "zb-h1", 2, mode, "foreach")]
            predicted, measured = run["state_rows"], run["bytes"]
            assert predicted["rank"] == rank % workers.PP
            assert {k: predicted[k] for k in measured} == measured, (mode, rank, predicted, measured)
            line = (
                f"rank {predicted['rank']}: parameters {si(predicted['params'], 'B')}, "
                f"gradients {si(predicted['grads'], 'B')}, optimizer {si(predicted['optimizer'], 'B')}"
            )
            assert line in run["explain"], (line, run["explain"])
            assert "peak activations per rank" in run["explain"]


def test_zb_auto_counts_each_stages_reduction(per_rank):
    """With 2 replicas zb-auto solves with each stage's reduction time (its gradient bytes over
    the largest boundary message's, times that message's): an all-reduce moves twice a
    reduce-scatter's bytes; explain() shows them. 1f1b (the same compile) records the same
    times: its predicted step has the same tails, though nothing is solved with them."""
    for name in ("gpt", "llama"):
        replicate = per_rank[0][(name, "zb-auto", 2, "replicate", "foreach")]["reduction"]
        shard = per_rank[0][(name, "zb-auto", 2, "shard", "foreach")]["reduction"]
        assert len(replicate) == 2 and all(r > 0 for r in replicate), replicate
        assert list(shard) == [r / 2 for r in replicate], (replicate, shard)
        assert (
            "gradient reduction over the replicas" in per_rank[0][(name, "zb-auto", 2, "shard", "foreach")]["explain"]
        )
        for result in per_rank:
            assert result[(name, "zb-auto", 2, "shard", "foreach")]["reduction"] == shard
            assert result[(name, "1f1b", 2, "shard", "foreach")]["reduction"] == shard


def test_grad_dtype_under_shard_equals_replicate_bitwise(per_rank):
    """A bf16 model with grad_dtype=float32: "shard" accumulates and reduce-scatters in float32,
    the same bits as "replicate"'s all-reduce (two replicas: a + b)."""
    for result in per_rank:
        replicate, shard = result["grad_dtype"]["replicate"], result["grad_dtype"]["shard"]
        assert replicate["param_dtypes"] == shard["param_dtypes"] == {torch.bfloat16}
        assert shard["grad_types"] == {"DTensor"} and replicate["grad_types"] == {"Tensor"}
        assert replicate["grads"].keys() == shard["grads"].keys() and replicate["grads"]
        for fqn, grad in replicate["grads"].items():
            assert grad.dtype == shard["grads"][fqn].dtype == torch.float32, fqn
            assert torch.equal(grad, shard["grads"][fqn]), fqn


def test_gradient_reduction_starts_before_the_ranks_last_action(per_rank):
    """Under zbv each rank holds two stages; the one whose last W comes first has its gradients
    on their way while the rank still computes."""
    for key in (("gpt", "zbv", 4, "replicate", "foreach"), ("gpt", "zbv", 4, "shard", "foreach")):
        for rank, result in enumerate(per_rank):
            last = max(end for _, _, end in result[key]["timeline"])
            reductions = [
                (label, start) for label, start, _ in result[key]["comm_timeline"] if label.startswith("REDUCE")
            ]
            assert any(start < last for _, start in reductions), (key, rank, reductions, last)


def test_a_leading_dimension_the_replicas_do_not_divide_is_sharded_unevenly(per_rank):
    """The masked model's `out.weight` (3 x 12): replica 0 holds 2 rows, replica 1 one."""
    key = ("masked", "dualpipe", 2, "shard", "foreach")
    held = [r[key]["local_rows"]["out.weight"] for r in per_rank if "out.weight" in r[key]["local_rows"]]
    assert sorted(held) == [1, 1, 2, 2], held  # both ranks of each replica hold it under dualpipe


def test_the_trace_shows_reductions_under_the_ranks_remaining_work(per_rank):
    """The dump's trace of the last run (zbv, shard): every step, each stage's reduction is posted
    when its last W or B ends, before the rank's next action starts; so every stage whose last
    gradient action is not the rank's last action is reduced under the rank's remaining work
    (with two stages per rank, one of them). The actions are the schedule's, once each."""
    compiled = os.path.join(launches.directory("four-ranks"), "dump", "compile-0")
    trace = load_trace(compiled)
    with open(os.path.join(compiled, SCHEDULE_FILE)) as f:
        versions = json.load(f)["versions"]
    assert validate_trace(trace, [v["lowered"] for v in versions]) == []
    slack_us = 100  # the post and the actions' ends are read from one host clock, a few calls apart
    for step in range(workers.STEPS):
        for rank in range(4):
            actions = [e for e in action_events(trace) if e["pid"] == rank and e["args"]["step"] == step]
            posts = {
                e["name"]: e["ts"] for e in reduction_events(trace) if e["pid"] == rank and e["args"]["step"] == step
            }
            last_end = max(e["ts"] + e["dur"] for e in actions)
            parsed = [(Action.parse(e["name"]), e) for e in actions]
            early = 0
            for stage in {a.stage for a, _ in parsed}:
                grads = [e for a, e in parsed if a.stage == stage and a.kind in ("W", "B")]
                done = max(e["ts"] + e["dur"] for e in grads)
                later = [e["ts"] for e in actions if e["ts"] >= done]
                posted = posts[f"REDUCE {stage}"]
                assert done - slack_us <= posted <= min(later, default=posted) + slack_us, (step, rank, stage)
                early += done < last_end
                if done < last_end:
                    assert posted < last_end, (step, rank, stage)
            assert early == 1, (step, rank)  # zbv: two stages per rank, one finishing before the other


def test_checkpoint_round_trip_under_shard(per_rank):
    for result in per_rank:
        assert result["checkpoint"] and all(result["checkpoint"].values()), result["checkpoint"]


def test_post_validation_under_shard_equals_the_synchronous_reference_bitwise(per_rank):
    """5 steps clipped at max_norm 0.5, an Inf at step 2 (skipped everywhere)."""
    for result in per_rank:
        post, sync = result["post_validation"]["post"], result["post_validation"]["sync"]
        assert post["history"] == sync["history"]
        assert [skipped for _, _, skipped in post["history"]] == [False, False, True, False, False]
        assert any(clipped for _, clipped, _ in post["history"])
        for fqn, value in sync["params"].items():
            assert torch.equal(post["params"][fqn], value), fqn
            for k, v in sync["optimizer"][fqn].items():
                assert torch.equal(post["optimizer"][fqn][k], v), f"{fqn}.{k}"


def test_data_parallel_mistakes_are_clear_errors(per_rank):
    for rank, result in enumerate(per_rank):
        errors = result["errors"]
        assert errors["no replicas"].startswith("ValueError") and "1 replica" in errors["no replicas"], errors
        assert "data_parallel must be one of" in errors["unknown"], errors
        assert errors["world"].startswith("ValueError") and "world size 4" in errors["world"], errors
        assert "3 ranks per pipeline" in errors["world"] and "launch a multiple of 3" in errors["world"], errors
        assert errors["scalar"].startswith("ValueError") and "'scale' is a scalar" in errors["scalar"], errors
        sizes = errors["batch sizes"]
        assert sizes.startswith("ValueError") and "batches of different sizes" in sizes, errors
        others = [r for r in range(4) if r % workers.PP == rank % workers.PP]
        assert all(f"rank {r}: {n}" in sizes for r, n in zip(others, (4, 8))), sizes
