"""The forward-only schedule of evaluation: every microbatch's F once on every stage, in
microbatch order per stage, deadlock-free once lowered, for in-line and V placements."""

from __future__ import annotations

import pytest

from zbcompile.schedules import Action, forward_only, lower


@pytest.mark.parametrize("stage_to_rank", [(0,), (0, 1), (0, 1, 2, 3), (0, 1, 1, 0), (0, 1, 0, 1)], ids=str)
@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_every_forward_once_in_microbatch_order_and_lowers_without_deadlock(stage_to_rank, microbatches):
    schedule = forward_only(stage_to_rank, microbatches)
    actions = [a for row in schedule.actions for a in row]
    assert sorted(actions) == sorted(Action(s, "F", k) for s in range(len(stage_to_rank)) for k in range(microbatches))
    for rank, row in enumerate(schedule.actions):
        assert all(stage_to_rank[a.stage] == rank for a in row)
        for stage in {a.stage for a in row}:
            assert [a.microbatch for a in row if a.stage == stage] == list(range(microbatches))
    lowered = lower(schedule)  # checks the messages for deadlock
    assert {a.kind for row in lowered.actions for a in row} <= {"F", "SEND_F", "RECV_F"}


def test_a_rank_runs_a_deeper_stage_as_soon_as_its_input_is_ready():
    """On a V, rank 0 runs stage 3 of microbatch 0 as soon as it can rather than every stage-0 F
    first: microbatches leave the pipeline while others enter it."""
    row = forward_only((0, 1, 1, 0), 6).actions[0]
    assert row.index(Action(3, "F", 0)) < row.index(Action(0, "F", 5))


def test_no_microbatches_is_refused():
    with pytest.raises(ValueError, match="at least one microbatch"):
        forward_only((0, 1), 0)
