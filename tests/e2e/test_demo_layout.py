"""`zbcompile demo`'s choices: the layout for a machine's cores and GPUs, the model's size from a
block's measured time, and the summary it prints (paired speed-up, captured share, busy machine).
No processes are started."""

from __future__ import annotations

import math
import os

import pytest

from zbcompile import demo, measure
from zbcompile.schedules.render import IDLE, Box, idle_boxes


@pytest.mark.parametrize(
    "cores, ranks, microbatches, threads, shares",
    [
        (1, 2, 4, 1, True),  # a pipeline needs 2 ranks: they share the core
        (2, 2, 4, 1, False),
        (4, 4, 8, 1, False),
        (8, 8, 16, 1, False),
        (16, 8, 16, 2, False),  # at most MAX_RANKS ranks; the other cores become threads
    ],
)
def test_layout_on_cpu(cores, ranks, microbatches, threads, shares):
    layout = demo.choose_layout(cores=cores, gpus=0)
    assert (layout.ranks, layout.stages, layout.microbatches, layout.threads) == (ranks, ranks, microbatches, threads)
    assert layout.backend == "gloo" and layout.shares_cores is shares
    assert layout.spare_cores == max(0, cores - ranks * threads)
    line = layout.describe()
    assert line.startswith(f"{cores} core") and f"{ranks} gloo ranks" in line and f"{microbatches} microbatches" in line
    assert ("sharing it: a pipeline needs 2" in line) is shares


def test_layout_reads_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(demo, "available_gpus", lambda: 0)
    layout = demo.choose_layout()
    assert (layout.cores, layout.ranks, layout.stages, layout.microbatches) == (4, 4, 4, 8)


@pytest.mark.parametrize("gpus, ranks, backend", [(1, 2, "gloo"), (2, 2, "nccl"), (4, 4, "nccl"), (16, 8, "nccl")])
def test_layout_with_gpus(gpus, ranks, backend):
    layout = demo.choose_layout(cores=2, gpus=gpus)
    assert (layout.ranks, layout.stages, layout.microbatches, layout.backend) == (ranks, ranks, 2 * ranks, backend)
    assert not layout.shares_cores and layout.spare_cores == 0
    if backend == "nccl":  # a GPU's rank drives it from one core
        assert demo.choose_layout(cores=16, gpus=gpus).spare_cores == 16 - ranks
    else:
        assert "1 GPU: a pipeline needs 2, so on CPU" in layout.describe()


def test_layout_refuses_no_cores():
    with pytest.raises(ValueError, match="cores >= 1"):
        demo.choose_layout(cores=0, gpus=0)


def test_model_size_lands_in_the_step_range():
    def block_seconds(hidden: int) -> float:  # a machine where a block costs 20 ms at width 256
        return 0.02 * (hidden / 256) ** 2

    for cores in (1, 2, 4, 8):
        layout = demo.choose_layout(cores=cores, gpus=0)
        size = demo.size_model(layout, block_seconds)
        low, high = demo.STEP_RANGE_S
        assert low <= size.step_s <= high, (cores, size)
        assert size.layers % layout.stages == 0 and size.layers >= layout.stages
        slots = layout.microbatches + layout.stages - 1
        slowdown = max(1.0, layout.ranks / layout.cores)
        assert math.isclose(size.step_s, slots * size.layers // layout.stages * block_seconds(size.hidden) * slowdown)
        wider = [h for h in demo.WIDTHS if h > size.hidden]
        assert not wider or slots * block_seconds(wider[0]) * slowdown > demo.TARGET_STEP_S, "a wider model fits"
    assert demo.size_model(demo.choose_layout(cores=2, gpus=0), block_seconds).hidden == 256


def test_model_size_on_a_slow_machine_takes_the_smallest_width():
    size = demo.size_model(demo.choose_layout(cores=2, gpus=0), lambda hidden: 1.0)
    assert (size.hidden, size.layers) == (demo.WIDTHS[0], 2)


def test_summary_arithmetic_and_lines():
    periods = {"1f1b": [0.30, 0.28, 0.32], "zb-auto": [0.25, 0.24, 0.26]}
    summary = demo.summarize(periods, predicted=(1.25, 1.3, "measured"), others_cores=0.02, spare_cores=0)
    assert summary.step_s == {"1f1b": 0.30, "zb-auto": 0.25}
    assert math.isclose(summary.speedup, 1.2)  # the median of 1.2, 1.1667, 1.2308
    assert math.isclose(summary.captured, 0.8)
    assert not summary.busy
    layout = demo.choose_layout(cores=2, gpus=0)
    text = "\n".join(summary.lines(layout, {"1f1b": 2.5, "zb-auto": 2.5}))
    assert "zb-auto vs 1f1b: 1.200x the speed (faster; median over 3 rounds" in text
    assert (
        "predicted gain for 2 stages x 4 microbatches: 1.250x (steady state, each schedule timed by its own measured "
        "actions, the optimizer step and batch as measured; 1.300x under the measured costs"
        in text
    )
    assert "captured: 80%" in text
    assert "the same: every schedule computes the same gradients" in text
    assert "machine quiet: other processes used 2% of a core" in text


def test_summary_calls_out_a_busy_machine_and_shared_cores():
    periods = {"1f1b": [0.30], "zb-auto": [0.33]}
    busy = demo.summarize(periods, predicted=(1.25, 1.25, "static"), others_cores=0.45, spare_cores=0)
    assert busy.busy and busy.speedup < 1
    line = busy.machine_line(demo.choose_layout(cores=2, gpus=0))
    assert line.startswith("machine was BUSY: other processes used 45% of a core during the run")
    # other processes on cores the ranks leave free do not count
    assert not demo.summarize(periods, (1.25, 1.25, "static"), others_cores=0.45, spare_cores=1).busy
    shared = busy.machine_line(demo.choose_layout(cores=1, gpus=0))
    assert shared.startswith("UNRELIABLE: 2 ranks shared 1 core(s)")
    assert math.isnan(demo.summarize(periods, (1.0, 1.0, "static"), 0.0, 0).captured)  # nothing was predicted


def test_paired_ratio_needs_the_same_rounds():
    with pytest.raises(ValueError, match="pair the same rounds"):
        measure.paired_ratio([1.0, 2.0], [1.0])


def test_others_cores():
    assert math.isclose(measure.others_cores(wall_s=2.0, machine_busy_s=3.0, own_cpu_s=[1.0, 1.0]), 0.5)
    assert measure.others_cores(2.0, 1.0, [1.0, 1.0]) == 0.0  # clock ticks round: never below zero


def test_idle_boxes_are_the_gaps_inside_each_rank_span():
    boxes = [
        Box(0, 0.0, 1.0, "0", "F"), Box(0, 2.0, 3.0, "1", "F"), Box(0, 3.0, 4.0, "0", "W"),
        Box(1, 1.5, 2.0, "0", "F"), Box(1, 2.5, 3.5, "0", "I"), Box(1, 2.6, 2.7, "", "RECV_F"),
    ]
    gaps = idle_boxes(boxes)
    assert [(g.rank, g.start, g.end, g.kind) for g in gaps] == [(0, 1.0, 2.0, IDLE), (1, 2.0, 2.5, IDLE)]


def test_summary_without_proc_stat_says_the_load_is_unknown():
    summary = demo.summarize({"1f1b": [0.3], "zb-auto": [0.25]}, (1.25, 1.25, "static"), float("nan"), 0)
    assert not summary.busy
    assert summary.machine_line(demo.choose_layout(cores=2, gpus=0)).startswith(
        "other processes' CPU use during the run is unknown"
    )


def test_predicted_gains_when_zb_auto_was_recut_into_a_v():
    """zb-auto's re-cut may run a V of two chunks per rank beside 1F1B's one stage per rank: each
    schedule's measured costs are its own stages', and 1F1B under zb-auto's solved costs sums a
    V's chunks into the stages that hold them."""
    from types import SimpleNamespace

    from zbcompile.schedules import Costs, make_schedule, simulate

    chunk = Costs(f=1.0, i=1.0, w=0.8, comm=0.0)
    v = make_schedule("zbv", 4, 8, chunk, ranks=2).with_info(cost_source="measured")
    one_f_one_b = make_schedule("1f1b", 2, 8, Costs(f=2.0, i=2.0, w=1.6))

    def run(schedule, stages):
        compiled = SimpleNamespace(schedule_costs=lambda: Costs(f=[1.0] * stages, i=[1.0] * stages, w=[1.0] * stages))
        return SimpleNamespace(pipe=SimpleNamespace(schedule=schedule, compiled=compiled, measured_costs=chunk))

    runs = {demo.REFERENCE_SCHEDULE: run(one_f_one_b, 2), demo.DEFAULT_SCHEDULE: run(v, 4)}
    medians = {
        demo.REFERENCE_SCHEDULE: [{(s, k): t for s in range(2) for k, t in (("F", 2.0), ("B", 3.6))}],
        demo.DEFAULT_SCHEDULE: [{(s, k): t for s in range(4) for k, t in (("F", 1.0), ("I", 1.0), ("W", 0.8))}],
    }
    measured, solved, source = demo.predicted_gains(runs, medians, {name: 0.0 for name in demo.SCHEDULES})
    in_line = Costs(f=2.0, i=2.0, w=1.6)  # two chunks of each stage
    expected = simulate(one_f_one_b, in_line).span / simulate(v, chunk).span
    assert source == "measured" and solved == pytest.approx(expected) and measured == pytest.approx(expected)
