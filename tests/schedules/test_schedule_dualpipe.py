"""Bidirectional DualPipe: two copies of a p-stage pipeline, copy 0 down (stage s on rank s) for
the first half of the microbatches, copy 1 up (stage s on rank p-1-s) for the rest. Validator-clean
(deadlock-free after lowering) for p = 2..8 even and m = p..4p; DeepSeek's phases; less bubble
than 1F1B on uniform costs."""

import dataclasses
import functools

import pytest

from zbcompile.schedules import Costs, ScheduleError, lower, make_schedule, simulate, validate
from zbcompile.schedules.ir import Action, Schedule

pytestmark = pytest.mark.xdist_group("v_shapes")

CASES = [(p, m) for p in range(2, 9, 2) for m in range(p, 4 * p + 1)]
UNIFORM = Costs()
COMM = Costs(f=1.0, i=1.0, w=1.0, comm=0.1)


@functools.cache
def built(p, m, costs=UNIFORM):
    """``make_schedule`` validates: placement, completeness, order, deadlock, lowering."""
    return make_schedule("dualpipe", p, m, costs)


@pytest.mark.parametrize("p", range(2, 9, 2))
def test_validates_and_places_each_copy_at_its_end(p):
    for m in range(p, 4 * p + 1):
        sched = built(p, m)
        down = sched.mirrored_from
        assert sched.ranks == p and sched.stages == p and down == (m + 1) // 2
        for rank, row in enumerate(sched.actions):
            assert {a.stage for a in row} == {rank, p - 1 - rank}, (p, m, rank)
            for a in row:
                assert a.stage == (rank if a.microbatch < down else p - 1 - rank), (p, m, str(a))
        validate(lower(sched), check_lowering=False)  # the lowered programs replay without deadlock


def test_rank_of_ranks_of_and_stages_on():
    sched = built(4, 8)
    assert sched.stage_to_rank == (0, 1, 2, 3) and sched.mirrored_from == 4
    assert [sched.rank_of(1, k) for k in (0, 3, 4, 7)] == [1, 1, 2, 2]
    assert [sched.ranks_of(s) for s in range(4)] == [(0, 3), (1, 2), (2, 1), (3, 0)]
    assert [sched.stages_on(r) for r in range(4)] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    single = built(4, 8).compute_only()
    assert single.placement == ((0, 1, 2, 3), 4)
    plain = make_schedule("1f1b", 4, 8)
    assert plain.rank_of(1, 7) == 1 and plain.ranks_of(1) == (1,) and plain.stages_on(2) == [2]


def test_the_validator_places_actions_by_microbatch():
    sched = built(4, 8)
    with pytest.raises(ScheduleError, match="rank 0: 3F4 belongs to stage 3, which runs microbatch 4 on rank 3"):
        validate(dataclasses.replace(sched, mirrored_from=None))
    with pytest.raises(ValueError, match="mirrored_from=8 must split the 8 microbatches"):
        dataclasses.replace(sched, mirrored_from=8)


def test_odd_stage_counts_and_a_single_microbatch_are_refused():
    for p in (3, 5):
        with pytest.raises(ValueError, match="even number of stages"):
            make_schedule("dualpipe", p, 2 * p)
    with pytest.raises(ValueError, match="at least 2"):
        make_schedule("dualpipe", 4, 1)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_deepseeks_phases(p):
    """Rank r (h = min(r, p-1-r)) starts as DeepSeek's DualPipe does: 2(p/2-h-1) forwards of the
    copy in which it sits at position h, then h+1 pairs of forwards (that copy, the other); with m
    even, ranks r and p-1-r run the same program with the copies swapped."""
    m = 2 * p
    sched = built(p, m)
    half = m // 2
    for r, row in enumerate(sched.actions):
        h = min(r, p - 1 - r)
        near = 0 if r < p // 2 else half  # the first microbatch of the copy where rank r is at position h
        far = half - near
        warmup = [Action(h, "F", near + k) for k in range(2 * (p // 2 - h - 1))]
        pairs = [
            a for k in range(h + 1) for a in (Action(h, "F", near + len(warmup) + k), Action(p - 1 - h, "F", far + k))
        ]
        assert list(row[: len(warmup) + len(pairs)]) == warmup + pairs, (p, r)
        mirror = sched.actions[p - 1 - r]
        assert [(a.stage, a.kind, (a.microbatch + half) % m) for a in row] == [
            (a.stage, a.kind, a.microbatch) for a in mirror
        ]


def test_less_bubble_than_1f1b_at_one_more_microbatch_of_memory():
    """On uniform costs (with and without communication delay) DualPipe's bubble is below
    1F1B's; its peak activation memory is at most p+1 microbatches of a stage (DeepSeek's PP+1)."""
    for costs in (UNIFORM, COMM):
        for p, m in CASES:
            ours = simulate(built(p, m, costs), costs)
            reference = simulate(make_schedule("1f1b", p, m, costs), costs)
            assert ours.bubble_rate < reference.bubble_rate, (p, m, costs)
            assert ours.span < reference.span, (p, m, costs)
            assert max(ours.peak_memory) <= p + 1, (p, m)


def test_csv_round_trip_keeps_the_actions():
    sched = built(4, 6)
    rows = [[Action.parse(cell) for cell in line.split(",")] for line in sched.to_csv().splitlines()]
    assert tuple(tuple(r) for r in rows) == sched.actions
    with pytest.raises(ValueError, match="each stage must run on exactly one rank"):
        Schedule.from_csv(sched.to_csv())
