"""Schedule IR, handcrafted generators, simulator, validator and lowering (pure Python)."""

import subprocess
import sys

import pytest

from zbcompile.schedules import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Costs,
    Schedule,
    ScheduleError,
    lower,
    make_schedule,
    schedule_spec,
    simulate,
    validate,
)
from zbcompile.schedules.heuristic import minimum_memory
from zbcompile.schedules.ir import format_grid


def test_importing_schedules_does_not_import_torch():
    # ortools and matplotlib must stay lazy too.
    code = (
        "import sys\n"
        "import zbcompile.schedules, zbcompile.schedules.cli\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'ortools', 'matplotlib'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_action_text_round_trip():
    a = Action(stage=0, kind="F", microbatch=3)
    assert str(a) == "0F3"
    assert Action.parse("1SEND_B2") == Action(1, "SEND_B", 2)
    for text in ("12I7", "3W0", "2B1", "4RECV_F9", "0SEND_F0", "5RECV_B11"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F3")
    with pytest.raises(ValueError, match="unknown action kind"):
        Action(0, "X", 1)


def test_action_kinds_are_an_enum_whose_text_is_the_schedule_formats():
    texts = ("0F3", "2I1", "2W1", "1B0", "1SEND_F3", "2RECV_F3", "1SEND_B2", "0RECV_B2")
    parsed = [Action.parse(text) for text in texts]
    assert all(type(a.kind) is ActionKind for a in parsed) and [str(a) for a in parsed] == list(texts)
    assert [a.kind for a in parsed] == list(ActionKind)
    assert Action(0, "F", 3) == Action(0, ActionKind.F, 3)
    assert hash(Action(0, "F", 3)) == hash(Action(0, ActionKind.F, 3))
    assert ActionKind.SEND_B == "SEND_B" and f"{ActionKind.SEND_B}" == str(ActionKind.SEND_B) == "SEND_B"
    assert {"I": 1}[Action(0, "I", 0).kind] == 1  # tables keyed by text still find an enum kind
    sched = make_schedule("zb-h1", stages=2, microbatches=3)
    text = sched.to_csv()
    assert "ActionKind" not in text and Schedule.from_csv(text, name="zb-h1").to_csv() == text


def test_csv_round_trip_and_grid():
    sched = make_schedule("zb-h1", stages=3, microbatches=4)
    again = Schedule.from_csv(sched.to_csv(), name="zb-h1")
    assert again.actions == sched.actions
    assert again.stage_to_rank == sched.stage_to_rank
    grid = sched.grid()
    assert grid.splitlines()[0].split() == ["Rank", "0", "Rank", "1", "Rank", "2"]
    assert grid.splitlines()[1].startswith("Step 00: 0F0")
    assert format_grid([["a"], ["b", "c"]]).count("Step") == 2


UNIFORM = [(1, 1, 1), (3, 2, 1), (18.522, 18.086, 9.337), (29.718, 29.444, 19.927), (2, 3, 1.5)]


@pytest.mark.parametrize("f,b,w", UNIFORM)
def test_table2_bubbles_and_memory(f, b, w):
    """Paper Table 2: bubble = span - m(F+B+W); memory p M_B (1F1B, ZB-H1), (2p-1) M_B (ZB-H2)."""
    costs = Costs(f=f, i=b, w=w)
    for p in range(2, 17):
        for m in (2 * p, 3 * p + 1):
            expected = {
                "1f1b": ((p - 1) * (f + b + w), p),
                "zb-h1": ((p - 1) * (f + b - w), p),
                "zb-h2": ((p - 1) * (f + b - 2 * w), 2 * p - 1),
            }
            for name, (bubble, memory) in expected.items():
                res = simulate(make_schedule(name, p, m, costs, check=(p <= 4)), costs)
                assert res.span - m * (f + b + w) == pytest.approx(bubble, abs=1e-6), (name, p, m)
                assert max(res.peak_memory) == pytest.approx(memory), (name, p, m)


def test_fused_and_split_kinds():
    assert {a.kind for row in make_schedule("1f1b", 4, 8).actions for a in row} == {"F", "B"}
    assert {a.kind for row in make_schedule("gpipe", 4, 8).actions for a in row} == {"F", "B"}
    for name in ("zb-h1", "zb-h2", "zb-auto", "zbv"):
        kinds = {a.kind for row in make_schedule(name, 4, 8, time_budget=0).actions for a in row}
        assert kinds == {"F", "I", "W"}, name


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", [(4, 8), (4, 4), (2, 6), (6, 12)])
def test_every_schedule_validates_and_keeps_microbatch_order(name, p, m):
    sched = make_schedule(name, p, m, Costs(f=1, i=1.2, w=0.6, comm=0.1), time_budget=0)
    assert sched.stages == p and sched.microbatches == m and len(sched.stage_to_rank) == p
    for row in sched.actions:
        for stage in range(p):
            for group in ("F", "IB", "W"):
                mbs = [a.microbatch for a in row if a.stage == stage and a.kind in group]
                assert mbs == sorted(mbs)
    lowered = lower(sched)
    validate(lowered)
    assert lowered.compute_only().actions == sched.actions


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", [2, 4, 6])
def test_schedule_table_agrees_with_what_each_builder_makes(name, p):
    spec = schedule_spec(name)
    sched = make_schedule(name, p, 2 * p, time_budget=0)
    assert sched.name == name
    assert sched.stage_to_rank == spec.placement(p)
    assert sched.ranks == spec.ranks(p)
    assert len(sched.actions) == spec.ranks(p)
    # a memory limit shapes exactly the solved schedules: below the fixed orders' peak they fail
    peak = max(simulate(sched).peak_memory)
    tight = max(peak - 0.5, *minimum_memory(spec.placement(p), Costs().resolve(p)))
    if spec.solved:
        assert max(simulate(make_schedule(name, p, 2 * p, memory_limit=tight, time_budget=0)).peak_memory) <= tight
    elif tight < peak:
        with pytest.raises(ScheduleError, match="exceeds the limit"):
            make_schedule(name, p, 2 * p, memory_limit=tight)


def test_fewer_microbatches_than_stages():
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto"):
        validate(make_schedule(name, 6, 2, time_budget=0))
    with pytest.raises(ValueError, match="interleaved-1f1b.*3 microbatches for 2 ranks"):
        make_schedule("interleaved-1f1b", 4, 3)


def test_zero_costs_and_empty_stage0_input_gradient():
    costs = Costs(f=[1, 1, 1], i=[0, 1, 1], w=[1, 0, 1])
    for name in ("1f1b", "zb-h1", "zb-auto"):
        sched = make_schedule(name, 3, 6, costs, time_budget=0)
        res = simulate(sched, costs)
        assert res.makespan > 0 and 0 <= res.bubble_rate < 1


def test_simulator_measures():
    costs = Costs(f=1, i=2, w=1, comm=0.5)
    res = simulate(make_schedule("gpipe", 2, 1), costs)
    # F0 on rank 0 [0,1], comm, F0 on rank 1 [1.5,2.5], B [2.5,5.5], comm, B on rank 0 [6,9]
    assert res.makespan == pytest.approx(9.0)
    assert res.rank_span == pytest.approx((9.0, 4.0))
    assert res.span == pytest.approx(9.0)
    assert res.bubble_rate == pytest.approx(1 - 8 / 18)
    assert res.idle_time == pytest.approx((5.0, 0.0))
    assert res.peak_memory == (1.0, 1.0)


def test_validator_names_rank_action_and_rule():
    good = make_schedule("1f1b", 2, 2)
    rows = [list(r) for r in good.actions]
    swapped = Schedule("bad", 2, 2, (0, 1), [rows[0], [rows[1][1], rows[1][0]] + rows[1][2:]])
    with pytest.raises(ScheduleError, match="rank 1: 1B0 runs before 1F0"):
        validate(swapped)
    missing = Schedule("bad", 2, 2, (0, 1), [rows[0][:-1], rows[1]])
    with pytest.raises(ScheduleError, match=r"rank 0: 0I1, 0W1 missing \(needs B, or I and W\)"):
        validate(missing)
    out_of_order = Schedule("bad", 1, 2, (0,), [["0F1", "0F0", "0B0", "0B1"]])
    with pytest.raises(ScheduleError, match="increasing microbatch order"):
        validate(out_of_order)
    # rank 0 waits for 1B0 before its F1, rank 1 runs B0 only after F1: a cycle
    cycle = Schedule.from_rows([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(ScheduleError, match="rank 1 waits at 1F1 for 0F1"):
        validate(cycle)
    with pytest.raises(ScheduleError, match="rank 0: peak activation memory 4 exceeds the limit 3"):
        validate(make_schedule("gpipe", 2, 4), memory_limit=3)


def test_rendezvous_check_catches_misordered_messages():
    lowered = lower(make_schedule("1f1b", 2, 2))
    rows = [list(r) for r in lowered.actions]
    # move rank 1's receive of microbatch 1 after its first backward's send: rank 0 then blocks
    recv = Action(1, "RECV_F", 1)
    rows[1].remove(recv)
    rows[1].append(recv)
    broken = Schedule("broken", 2, 2, (0, 1), rows)
    with pytest.raises(ScheduleError, match="rank 1 blocks at 1F1 waiting for 1RECV_F1|deadlock"):
        validate(broken)


def test_multi_chunk_placements():
    inter = make_schedule("interleaved-1f1b", 8, 8)
    assert inter.ranks == 4 and inter.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    v = make_schedule("zbv", 8, 8, Costs(f=1, i=1, w=1))
    assert v.ranks == 4 and v.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    res = simulate(v, Costs(f=1, i=1, w=1))
    assert max(res.peak_memory) <= 4 * 2  # 1F1B's memory: p microbatches of a rank's two chunks
    lowered = lower(v)
    assert not any(a.kind == "SEND_F" and a.stage == 3 for row in lowered.actions for a in row)  # V turn is local


def test_errors_are_value_errors_that_say_what_to_do():
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'"):
        make_schedule("zb-h3", 4, 8)
    with pytest.raises(ValueError, match="3 values but the schedule has 4 stages"):
        make_schedule("1f1b", 4, 8, Costs(f=[1, 2, 3]))
    with pytest.raises(ValueError, match="below one microbatch"):
        make_schedule("zb-auto", 4, 8, memory_limit=0.5)
    with pytest.raises(ValueError, match="unknown objective"):
        make_schedule("zb-auto", 4, 8, objective="latency")
    with pytest.raises(TypeError):
        make_schedule("1f1b", 4, 8, costs={"f": 1})
