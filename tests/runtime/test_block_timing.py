"""What the cut decision measures, in one process: marked stage programs time every block inside
each action and compute the same bits as the unmarked ones (`runtime/block_timing.py`); measured
times become per-position costs on every rank, each rank's speed from the blocks it ran
(`runtime/measured_cut.py`), on fixed medians."""

import pytest
import torch

from helpers.models import build
from zbcompile.compiler import compile_pipeline
from zbcompile.passes.cut_profile import KINDS, cut_layout, program_work
from zbcompile.runtime.block_timing import UnitTimes, marked
from zbcompile.runtime.local import LocalRunner
from zbcompile.runtime.measured_cut import measured_units
from zbcompile.schedules import make_schedule
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
