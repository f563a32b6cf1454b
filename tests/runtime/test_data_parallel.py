"""Data parallelism on 4 gloo ranks, 2 replicas x a 2-rank pipeline, each replica given its own
half of the batch (DDP's convention): "replicate" and "shard" (DTensors over "dp") under in-line,
V and mirrored schedules, a zoo model and a transformers Llama, 3 AdamW steps against eager over
the whole batch; the gradient reduction overlapped with the step; post-validation, checkpoints
and errors under "shard". One launch for all of it."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import data_parallel_workers as workers
from helpers import models, real_models
from helpers.distributed_workers import make_optimizer
from helpers.multiprocess import run_ranks

pytestmark = pytest.mark.xdist_group("distributed")

RUNS = [
    *[("gpt", s, 2, "replicate", "foreach") for s in ("1f1b", "zb-h1", "zb-auto")],
    *[("gpt", s, 2, "shard", "foreach") for s in ("1f1b", "zb-h1", "zb-auto")],
    ("gpt", "zb-h1", 2, "shard", "fused"),
    ("mlp", "dualpipe", 2, "shard", "foreach"),
    ("llama", "zb-h1", 2, "replicate", "foreach"),
    ("llama", "zb-h1", 2, "shard", "foreach"),
    ("gpt", "zbv", 4, "replicate", "foreach"),
    ("gpt", "zbv", 4, "shard", "foreach"),  # last: its pipeline goes through a checkpoint round trip
]
CLOSE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    """Every rank's results of `RUNS` and the checks after them: the one 4-process launch."""
    return run_ranks(4, workers.train, RUNS, str(tmp_path_factory.mktemp("dcp")))


@functools.cache
def _eager(name: str) -> tuple[list[torch.Tensor], dict, dict]:
    """The first step's loss, then the parameters and AdamW state after `STEPS` eager steps over
    the whole batch."""
    case = real_models.build(name) if name in real_models.MODELS else models.build(name)
    optimizer = make_optimizer("adamw", case.model.parameters())
    losses = []
    for _ in range(workers.STEPS):
        optimizer.zero_grad()
        loss = case.eager_loss()
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
    params = dict(case.model.named_parameters())
    state = {n: optimizer.state[p] for n, p in params.items()}
    return losses, {n: p.detach() for n, p in params.items()}, state


def _replica(per_rank: list[dict], key: tuple, replica: int, field: str) -> dict:
    merged = {}
    for result in per_rank[replica * workers.PP : (replica + 1) * workers.PP]:
        merged.update(result[key][field])
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


def test_shard_equals_replicate_bitwise(per_rank):
    """The same schedule and optimizer, gradients reduce-scattered instead of all-reduced: with
    two replicas every element is the same sum (a + b), so the same bits."""
    pairs = [(k, (*k[:3], "shard", k[4])) for k in RUNS if k[3] == "replicate"]
    assert len(pairs) == 5
    for replicate, shard in pairs:
        for result in per_rank:
            for fqn, value in result[replicate]["params"].items():
                assert torch.equal(value, result[shard]["params"][fqn]), f"{shard}: {fqn}"


def test_shard_holds_dtensors_and_at_most_0_55_of_replicate_bytes(per_rank):
    for result in per_rank:
        replicate, shard = result[("gpt", "zb-h1", 2, "replicate", "foreach")], result[("gpt", "zb-h1", 2, "shard", "foreach")]
        assert all(shard["dtensor"].values()) and not any(replicate["dtensor"].values())
        assert set(shard["state_dict"].values()) == {"DTensor"}, shard["state_dict"]
        total = {label: sum(run["bytes"].values()) for label, run in (("replicate", replicate), ("shard", shard))}
        assert 0 < total["shard"] <= 0.55 * total["replicate"], total
        assert "data_parallel='shard' over 2 replicas" in shard["explain"], shard["explain"]


def test_gradient_reduction_starts_before_the_ranks_last_action(per_rank):
    """Under zbv each rank holds two stages; the one whose last W comes first has its gradients
    on their way while the rank still computes."""
    for key in (("gpt", "zbv", 4, "replicate", "foreach"), ("gpt", "zbv", 4, "shard", "foreach")):
        for rank, result in enumerate(per_rank):
            last = max(end for _, _, end in result[key]["timeline"])
            reductions = [(label, start) for label, start, _ in result[key]["comm_timeline"] if label.startswith("REDUCE")]
            assert any(start < last for _, start in reductions), (key, rank, reductions, last)


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
    for result in per_rank:
        errors = result["errors"]
        assert errors["no replicas"].startswith("ValueError") and "1 replica" in errors["no replicas"], errors
        assert "data_parallel must be one of" in errors["unknown"], errors
