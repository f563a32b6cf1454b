"""What the cut decision measures, in one process: marked stage programs time every block inside
each action and compute the same bits as the unmarked ones (`runtime/tuning/block_timing.py`), on the
host clock or with timing events read after the step (CUDA's way, never a device-wide
synchronize; events stood in for on CPU); measured
times become per-position costs on every rank, each rank's speed from the blocks it ran
(`runtime/tuning/measured_cut.py`), on fixed medians; and which cut of the other placement races
beside the decision (`recut._rival`)."""

import pathlib
import re
import statistics
from types import SimpleNamespace

import pytest
import torch

from helpers.models import build
from zbcompile.compiler import compile_pipeline
from zbcompile.passes.cut_profile import KINDS, cut_layout, program_work
from zbcompile.runtime.step.local import LocalRunner
from zbcompile.runtime.tuning import recut
from zbcompile.runtime.tuning.block_timing import UnitTimes, marked, unit_times
from zbcompile.runtime.tuning.measured_cut import agreed_speeds, measured_units, speeds_in_doubt
from zbcompile.schedules import Costs, make_schedule
from zbcompile.schedules.cut_choice import CutDecision, CutPrediction
from zbcompile.schedules.cut_search import Cut
from zbcompile.value_names import buffer_name, param_name


@pytest.fixture(scope="module")
def gpt():
    case = build("gpt")
    micro = [a[:2] for a in case.args]
    compiled = compile_pipeline(case.model, case.loss_fn, tuple(micro), {}, case.target[:2], 2)
    return case, compiled


def _step(case, compiled):
    state = {param_name(n): p for n, p in case.model.named_parameters()}
    state.update({buffer_name(n): b for n, b in case.model.named_buffers()})
    runner = LocalRunner(compiled, make_schedule("zb-h1", 2, 4), state)
    inputs = [{"input_0": case.args[0][2 * k : 2 * k + 2]} for k in range(4)]
    targets = [{"target_0": case.target[2 * k : 2 * k + 2]} for k in range(4)]
    runner.step(inputs, targets)
    return runner.reduce_grads()


def test_marked_programs_time_every_block_and_compute_the_same_bits(gpt):
    case, compiled = gpt
    times = UnitTimes()
    grads = _step(case, marked(compiled, times))
    assert all(torch.equal(grads[k], v) for k, v in _step(case, compiled).items())
    medians = times.medians()
    for stage, program in enumerate(compiled.programs):
        for kind in ("F", "W"):
            blocks = {u for (s, k, u) in medians if s == stage and k == kind and u.startswith("blocks.")}
            expected = {u for u in program_work(program)[kind] if u.startswith("blocks.")}
            assert blocks == expected, (stage, kind)
    assert all(len(v) == 4 for v in times.samples.values())  # one sample per microbatch's action
    assert all(seconds > 0 for seconds in medians.values())


class LogicalEvent:
    """A timing event on a logical clock: each record is 1 ms after the one before; counts queries."""

    now = 0.0
    queried: list["LogicalEvent"] = []

    def record(self) -> None:
        LogicalEvent.now += 1.0
        self.at = LogicalEvent.now

    def query(self) -> bool:
        LogicalEvent.queried.append(self)
        return True

    def elapsed_time(self, other: "LogicalEvent") -> float:
        return other.at - self.at


def test_events_time_the_same_units_read_after_the_step_without_a_device_wide_synchronize(gpt, monkeypatch):
    """With events (as on CUDA): the same (stage, kind, unit) samples as the host clock, each a
    whole number of pieces (1 ms per mark on the logical clock), read after the step by waiting
    for the last event alone; `torch.cuda.synchronize` is never called."""
    case, compiled = gpt

    def refused(*args, **kwargs):
        raise AssertionError("a device-wide synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", refused)
    host, events = UnitTimes(), UnitTimes(event_type=LogicalEvent)
    _step(case, marked(compiled, host))
    grads = _step(case, marked(compiled, events))
    assert all(torch.equal(grads[k], v) for k, v in _step(case, compiled).items())
    assert not events.samples  # nothing read inside the step
    LogicalEvent.queried = []
    medians = events.medians(timeout_s=1.0)
    assert len(LogicalEvent.queried) == 1  # the last event alone
    assert {k: len(v) for k, v in events.samples.items()} == {k: len(v) for k, v in host.samples.items()}
    assert all(round(s * 1e3) >= 1 and abs(s * 1e3 - round(s * 1e3)) < 1e-6 for v in events.samples.values() for s in v)
    assert medians.keys() == host.medians().keys()
    assert unit_times(torch.device("cpu")).event_type is None


def test_the_runtime_never_synchronizes_the_whole_device():
    """A device-wide synchronize waits for NCCL receives posted for peers that may wait for this
    rank: the runtime waits for its own events only."""
    runtime = pathlib.Path(__file__).parents[2] / "zbcompile" / "runtime"
    calls = re.compile(r"cuda\.synchronize\(|cuda\.current_stream\([^)]*\)\.synchronize\(")
    found = [f"{p.name}:{n}" for p in runtime.rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
             if calls.search(line)]
    assert not found, found


def test_measured_costs_become_positions_on_every_rank_by_its_speed(gpt):
    """Rank 1 runs every block 1.5x slower than the static estimates say rank 0 does, and the
    embedding on rank 0 takes 10 ms more than its share: the speeds are [1, 1.5]; each rank's
    positions sum to what it measured; a block moved to rank 0 costs 1/1.5 of its rank-1 time,
    and the embedding keeps its measured cost."""
    _, compiled = gpt
    layout = cut_layout(compiled.traced, compiled.partition)
    actions, units = {}, {}
    for stage, program in enumerate(compiled.programs):
        work = program_work(program)
        for kind in KINDS:
            for unit, (flops, written) in work[kind].items():
                seconds = (flops + 4 * written) * 1e-9 * (1.5 if stage == 1 else 1.0)
                seconds += 0.01 if (stage, kind, unit) == (0, "F", "tok_emb") else 0.0
                units[(stage, kind, unit)] = seconds
            actions[(stage, kind)] = sum(s for (st, k, _), s in units.items() if (st, k) == (stage, kind))
    cut_units, speeds = measured_units(layout, compiled.programs, [0, 1], 2, actions, units)
    assert speeds == pytest.approx([1.0, 1.5])
    bounds = layout.bounds
    for stage in range(2):
        for k, kind in enumerate(KINDS):
            own = sum(cut_units.times[stage][k][bounds[stage] : bounds[stage + 1]])
            assert own == pytest.approx(actions[(stage, kind)])
    last = bounds[2] - 1
    block = next(p for p in range(bounds[1], bounds[2]) if layout.keys[p].startswith("blocks."))
    assert cut_units.times[0][0][block] == pytest.approx(cut_units.times[1][0][block] / 1.5)
    embedding = next(p for p in range(bounds[1]) if layout.keys[p] == "tok_emb")
    assert cut_units.times[0][0][embedding] > 0.01 and cut_units.times[1][0][last] >= 0


def test_a_rank_is_slower_only_where_every_repetition_says_so_beyond_their_spread():
    slowed = [[1.0, 1.5], [1.0, 1.46], [1.0, 1.49], [1.0, 1.47]]
    assert agreed_speeds(slowed) == pytest.approx([1.0, 1.48])  # slowed in every one
    assert agreed_speeds(slowed[:2]) == [1.0, 1.0]  # in two steps only: one spell on the machine may do that
    assert agreed_speeds([[1.28, 1.0], [1.0, 1.02], [1.0, 1.0], [1.0, 1.01]]) == [1.0, 1.0]  # one burst
    assert agreed_speeds([[1.0, 1.04], [1.0, 1.03], [1.0, 1.04], [1.0, 1.03]]) == [1.0, 1.0]  # within the noise
    # they disagree by more than they say
    assert agreed_speeds([[1.0, 1.6], [1.0, 1.1], [1.0, 1.6], [1.0, 1.1]]) == [1.0, 1.0]
    # one burst among them (either way) is set aside
    assert agreed_speeds([[1.0, 3.0], [1.0, 1.4], [1.0, 2.9], [1.0, 3.1]]) == pytest.approx([1.0, 2.95])


def test_more_repetitions_are_asked_for_only_where_they_may_settle_a_rank():
    assert speeds_in_doubt([[1.0, 4.0], [1.0, 1.5]]) == [1]  # slower taken together, not agreed
    assert speeds_in_doubt([[1.28, 1.0], [1.0, 1.02]]) == [0]  # a burst: more steps tell
    assert speeds_in_doubt([[1.0, 1.5], [1.0, 1.46]]) == [1]  # agreed, but by too few to call it
    assert speeds_in_doubt([[1.0, 1.5], [1.0, 1.46], [1.0, 1.49], [1.0, 1.47]]) == []  # agreed
    assert speeds_in_doubt([[1.0, 1.04], [1.0, 1.03]]) == []  # within the noise
    assert speeds_in_doubt([[1.0, 3.0], [1.0, 1.4], [1.0, 2.9], [1.0, 3.1]]) == []


def _recorded(compiled, bias: dict[tuple[int, int], float], steps: int = 2) -> list[recut.Measured]:
    """Each rank's calibration of two equal ranks, as recorded: every action and unit its static
    work (1 ns per FLOP-equivalent), the actions of timed step k (of `steps`) on rank r
    `bias[(r, k)]` times that (the medians over the steps: the median of the steps')."""
    measured = []
    for stage, program in enumerate(compiled.programs):
        work = program_work(program)
        units = {(stage, k, u): (f + 4 * b) * 1e-9 for k in KINDS for u, (f, b) in work[k].items()}
        actions = {(stage, k): sum(v for (_, kind, _), v in units.items() if kind == k) for k in KINDS}
        per_step = tuple({key: v * bias.get((stage, step), 1.0) for key, v in actions.items()} for step in range(steps))
        pooled = {key: statistics.median(step[key] for step in per_step) for key in actions}
        measured.append(recut.Measured(pooled, units, 1e-5, per_step))
    return measured


def test_two_equal_ranks_are_not_recut_for_one_repetitions_burst(gpt):
    """Recorded as the report had it: in one timed step rank 0 ran its actions 1.28x slower (a
    burst of other work on a shared machine), in the other as fast as rank 1: the speeds come out
    equal and the decision is the one equal measurements give. Slowed 1.3x in both steps of one
    round (as a demo's calibration once measured two equal ranks), rank 0 is in doubt: more steps
    are timed; slowed 1.5x in all four steps of two rounds, it is 1.5x slower."""
    _, compiled = gpt
    schedule = make_schedule("zb-auto", 2, 4, compiled.schedule_costs(), time_budget=0)
    options = SimpleNamespace(microbatches=4, objective="span", memory_limit=None, solver_time_budget=0.05)
    burst = recut.decide(compiled, schedule, _recorded(compiled, {(0, 0): 1.28}), options, [0.0, 0.0])
    equal = recut.decide(compiled, schedule, _recorded(compiled, {}), options, [0.0, 0.0])
    assert burst.record["rank_speeds"] == [1.0, 1.0]
    doubt = recut.speeds_in_doubt(compiled, schedule)  # the calibration times more steps where in doubt
    assert doubt(_recorded(compiled, {(0, 0): 1.28})) and not doubt(_recorded(compiled, {}))
    spell = _recorded(compiled, {(0, 0): 1.3, (0, 1): 1.3})
    assert doubt(spell)
    assert recut.decide(compiled, schedule, spell, options, [0.0, 0.0]).record["rank_speeds"] == [1.0, 1.0]
    assert (burst.cut, burst.changes) == (equal.cut, equal.changes)
    four = _recorded(compiled, {(0, k): 1.5 for k in range(4)}, steps=4)
    assert not doubt(four)
    slowed = recut.decide(compiled, schedule, four, options, [0.0, 0.0])
    assert slowed.record["rank_speeds"] == pytest.approx([1.5, 1.0])


def test_the_rival_is_the_best_predicted_cut_of_the_other_placement_within_range():
    """`recut._rival`: the best candidate of the placement neither the cut in use nor the chosen
    one has, where it predicts within RIVAL_WITHIN of the chosen cut; none where both placements
    are taken or the other one predicts far slower."""
    def prediction(placement, positions, value):
        stages = len(positions) + 1
        return CutPrediction(Cut(placement, positions), value, Costs(f=[1.0] * stages), (0.0,) * 2)

    in_use, near = prediction("v", (10, 20, 30), 1.00), prediction("in-line", (22,), 1.02)
    farther = prediction("in-line", (18,), 1.10)
    kept = CutDecision(in_use, in_use, (prediction("v", (11, 20, 30), 0.99), near, farther))
    assert recut._rival(kept) is near  # the V kept: the best one-stage-per-rank cut races beside it
    slow = prediction("in-line", (22,), 1.00 * recut.RIVAL_WITHIN + 0.01)
    assert recut._rival(CutDecision(in_use, in_use, (slow,))) is None  # predicted far slower: not raced
    recut_to_line = CutDecision(in_use, near, (near, farther))
    assert recut._rival(recut_to_line) is None  # both placements race already
