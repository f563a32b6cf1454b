"""Optimizer post-validation: global gradient clipping and non-finite skipping without a barrier
before the optimizer step, with exact and reverse rollback.

Multi-process runs (gloo, GPT with its tied embedding, zb-h1): for SGD with momentum, Adam and
AdamW over 10 steps, post-validated training equals a synchronous reference (bitwise with
rollback="exact" against the one that sums the norm in the same order; within rtol 1e-6 of the
one built on torch.nn.utils' clipping, and with rollback="reverse"). An Inf injected into one
rank's gradients leaves every rank's parameters and optimizer state bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from helpers import launches
from helpers import post_validation_workers as workers

# --- multi-process equivalence -------------------------------------------------------------------


def _launch(world: int) -> list[tuple[int, list[dict]]]:
    """(stages, every rank's results) per pipeline, from the shared launch of `world` ranks: 2
    ranks run a 2-stage pipeline; 4 ranks a 4-stage pipeline, then 2 replicas x 2 stages."""
    if world == 4:
        per_rank, pipelines = launches.four_rank_results("post_validation"), launches.POST_VALIDATION_PIPELINES
    else:
        per_rank, pipelines = launches.two_rank_results("post_validation"), launches.POST_VALIDATION_TWO_RANKS
    return [(stages, per_rank) for stages, _ in pipelines]


@pytest.mark.parametrize(
    "world",
    [
        pytest.param(2, id="2ranks", marks=launches.READS_TWO_RANKS),
        pytest.param(4, id="4ranks+2replicas-x-2stages", marks=launches.READS_FOUR_RANKS),
    ],
)
def test_post_validation_across_processes(world):
    for launch in _launch(world):
        check_exact_rollback_is_bitwise_equal_to_the_synchronous_reference(launch)
        check_within_rtol_1e6_of_torch_clipping_and_with_reverse_rollback(launch)
        check_clipping_happens_on_some_steps_and_the_norm_counts_each_parameter_once(launch)
        check_an_inf_in_one_ranks_gradients_changes_nothing_anywhere(launch)
        check_replicas_and_tied_copies_stay_identical(launch)
        check_an_unvalidated_step_is_never_exposed_by_state_dict(launch)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within rtol 1e-6, elementwise and relative to the tensor's largest element (a moment
    that sums gradients of both signs can be near 0 where its terms are not)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1e-30), msg=what)


def _compare(result: dict, reference: dict, what: str, bitwise: bool) -> None:
    assert result["params"].keys() == reference["params"].keys(), what
    assert result["state"].keys() == reference["state"].keys(), what
    pairs = [(f"param {n}", result["params"][n], reference["params"][n]) for n in reference["params"]]
    for n, state in reference["state"].items():
        assert result["state"][n].keys() == state.keys(), f"{what}: state of {n}"
        pairs += [(f"state {n}.{k}", result["state"][n][k], v) for k, v in state.items()]
    for name, actual, expected in pairs:
        if bitwise:
            assert torch.equal(actual, expected), f"{what}: {name} differs"
        else:
            _close(actual, expected, f"{what}: {name}")


def _optimizers(per_rank: list[dict], stages: int) -> list[str]:
    return sorted({k[1] for k in per_rank[0] if k[0] == stages and k[1] != "layout"})


def check_exact_rollback_is_bitwise_equal_to_the_synchronous_reference(launch):
    stages, per_rank = launch
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            for fault in (False, True):
                _compare(
                    result[(stages, name, "exact", fault)],
                    result[(stages, name, "sync", fault)],
                    f"rank {rank} {name} fault={fault}",
                    True,
                )


def check_within_rtol_1e6_of_torch_clipping_and_with_reverse_rollback(launch):
    stages, per_rank = launch
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            sync = result[(stages, name, "sync", False)]
            _compare(
                result[(stages, name, "exact", False)],
                result[(stages, name, "torch", False)],
                f"rank {rank} {name} exact vs torch",
                False,
            )
            _compare(result[(stages, name, "reverse", False)], sync, f"rank {rank} {name} reverse", False)
            if (stages, name, "reverse", True) in result:
                _compare(
                    result[(stages, name, "reverse", True)],
                    result[(stages, name, "sync", True)],
                    f"rank {rank} {name} reverse+fault",
                    False,
                )


def check_clipping_happens_on_some_steps_and_the_norm_counts_each_parameter_once(launch):
    stages, per_rank = launch
    for name in _optimizers(per_rank, stages):
        histories = [r[(stages, name, "exact", False)]["history"] for r in per_rank]
        assert all(h == histories[0] for h in histories), f"{name}: ranks disagree on the verdicts"
        clipped = [c for _, c, _ in histories[0]]
        assert len(clipped) == workers.STEPS and any(clipped) and not all(clipped), f"{name}: {clipped}"
        # the tied embedding counted once, as torch's norm over every distinct parameter does
        torch_norms = [n for n, _, _ in per_rank[0][(stages, name, "torch", False)]["history"]]
        for ours, theirs in zip([n for n, _, _ in histories[0]], torch_norms):
            assert ours == pytest.approx(theirs, rel=1e-6), name
    layouts = [r[(stages, "layout")] for r in per_rank]
    assert all(layout["tied_owner"] for layout in layouts if layout["pp_rank"] in (0, stages - 1))


def check_an_inf_in_one_ranks_gradients_changes_nothing_anywhere(launch):
    stages, per_rank = launch
    fault_rank = stages // 2 - 1
    for rank, result in enumerate(per_rank):
        for name in _optimizers(per_rank, stages):
            run = result[(stages, name, "exact", True)]
            before, after = run["around_fault"]
            _compare(after, before, f"rank {rank} {name}: the step with an Inf", True)
            assert run["history"][workers.FAULT_STEP][2], f"{name}: the step was not skipped"
            if result[(stages, "layout")]["pp_rank"] > fault_rank:  # stepped optimistically, then undid it
                assert run["rollbacks"] >= 1
            steps = [int(s["step"].item()) for s in after["state"].values() if "step" in s]
            assert all(s == workers.FAULT_STEP for s in steps), steps  # the skipped step is not counted


def check_replicas_and_tied_copies_stay_identical(launch):
    stages, per_rank = launch
    for name in _optimizers(per_rank, stages):
        final = [r[(stages, name, "exact", False)]["params"] for r in per_rank]
        layouts = [r[(stages, "layout")] for r in per_rank]
        for a, la in zip(final, layouts):
            for b, lb in zip(final, layouts):
                for n in a.keys() & b.keys():  # the same parameter held by two ranks
                    assert torch.equal(a[n], b[n]), f"{name}: {n} differs between ranks {la} and {lb}"
        if len(per_rank) > stages:
            assert final[0].keys() == final[stages].keys()


def check_an_unvalidated_step_is_never_exposed_by_state_dict(launch):
    stages, per_rank = launch
    for result in per_rank:
        said = result[(stages, "adamw", "exact", False)]["refusals"]
        assert len(said) == 2 and all("opt.finish()" in s for s in said), said
