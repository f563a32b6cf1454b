"""The pure parts of data-parallel reduction and sharding: which gradients a stage's last W or B
makes final and in what order the stages post them; how leading dimensions are cut over replicas."""

from __future__ import annotations

from zbcompile.runtime.parallel.grad_reduction import ReductionPlan, _buckets
from zbcompile.runtime.parallel.sharding import Rows
from zbcompile.schedules import make_schedule
from zbcompile.schedules.lower import lower


def test_plan_of_a_v_schedule_posts_the_stage_that_finishes_first_first():
    """zbv on 2 ranks: rank 0 holds stages 0 and 3. Stage 3's last W comes before stage 0's, so it
    posts first; a parameter both use (a tied embedding) or another rank holds is left for after
    the drain."""
    actions = lower(make_schedule("zbv", 4, 4)).actions[0]
    params = {0: ("emb", "a"), 3: ("emb", "b", "tied")}
    plan = ReductionPlan.of(actions, params, shared=["tied"])
    assert plan.expected == {0: 4, 3: 4}
    assert plan.order == (3, 0)
    assert plan.overlapped == {0: frozenset({"a"}), 3: frozenset({"b"})}


def test_plan_counts_fused_backwards():
    actions = lower(make_schedule("1f1b", 2, 3)).actions[1]
    plan = ReductionPlan.of(actions, {1: ("w",)}, shared=[])
    assert plan.expected == {1: 3} and plan.order == (1,) and plan.overlapped == {1: frozenset({"w"})}


def test_rows_pad_as_fsdp2_and_split_as_torch_chunk():
    assert (Rows(3, 2).padded, Rows(3, 2).local(0), Rows(3, 2).local(1)) == (2, 2, 1)
    assert [Rows(1, 4).local(d) for d in range(4)] == [1, 0, 0, 0]
    assert [Rows(8, 4).local(d) for d in range(4)] == [2, 2, 2, 2]


def test_buckets_hold_one_dtype_and_at_most_the_bucket_size():
    import torch

    grads = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4, dtype=torch.float64), "d": torch.zeros(8)}
    assert _buckets(["a", "b", "c", "d"], grads, bucket_bytes=32) == [["a", "b"], ["c"], ["d"]]
