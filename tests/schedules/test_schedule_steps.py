"""Back-to-back steps in the simulator: with an end-of-step barrier (all-reduce of the gradient
norm before the optimizer) or with optimizer post-validation (no barrier)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zbcompile.schedules import SCHEDULE_NAMES, Costs, make_schedule, schedule_spec, simulate
from zbcompile.schedules.render import to_svg
from zbcompile.schedules.steps import compare_step_times, simulate_steps

COSTS = Costs(f=1.0, i=1.1, w=0.8, comm=0.2)


def _schedule(name: str, ranks: int = 4, microbatches: int = 8):
    stages = 2 * ranks if name in ("zbv", "interleaved-1f1b") else ranks
    return make_schedule(name, stages=stages, microbatches=microbatches, costs=COSTS, time_budget=0.2)


def test_importing_the_step_simulator_does_not_import_torch():
    code = "import sys, zbcompile.schedules.steps\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-auto"])
def test_a_step_with_a_barrier_takes_makespan_plus_allreduce_plus_optimizer(name):
    schedule = _schedule(name)
    costs = Costs(f=1.0, i=1.1, w=0.8, comm=0.2)
    result = simulate_steps(schedule, costs, "barrier", steps=5, optimizer=0.5, allreduce=0.7)
    assert result.step_time == pytest.approx(simulate(schedule, costs).makespan + 0.7 + 0.5)
    default = simulate_steps(schedule, costs, "barrier", steps=5)  # 2 comm log2(4)
    assert default.step_time == pytest.approx(simulate(schedule, costs).makespan + 4 * 0.2)


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if not schedule_spec(n).mirrored])
def test_post_validation_is_faster_than_the_barrier_on_four_ranks(name):
    """The all-reduce costs 2 comm log2(4) = 4 comm; the chains cost at most 3 comm on the
    critical path (when every rank ends at once, as in zb-h2), usually nothing."""
    schedule = _schedule(name)
    times = {mode: r.step_time for mode, r in compare_step_times(schedule, COSTS, optimizer=0.3).items()}
    assert times["post-validation"] <= times["barrier"] - 0.2 + 1e-9, times
    assert times["post-validation"] >= max(simulate(schedule, COSTS).busy) + 0.3 - 1e-9


def test_post_validation_chains_cross_dualpipe_on_its_critical_path():
    """In dualpipe every end rank is a first stage (of one copy) and a last stage (of the other),
    so both chains (last -> 0 after the step, 0 -> last before the next) lie on the critical
    path: post-validation costs up to 2 (ranks - 1) comm, here more than the barrier's 4 comm."""
    schedule = _schedule("dualpipe")
    times = {mode: r.step_time for mode, r in compare_step_times(schedule, COSTS, optimizer=0.3).items()}
    makespan = simulate(schedule, COSTS).makespan
    assert times["barrier"] == pytest.approx(makespan + 4 * 0.2 + 0.3)
    assert times["barrier"] < times["post-validation"] <= makespan + 0.3 + 2 * 3 * 0.2 + 1e-9, times


def test_without_communication_cost_post_validation_adds_nothing():
    """The chains ride along data the next step waits for anyway: with comm=0 and no all-reduce
    both modes take the same time."""
    costs = Costs(f=1.0, i=1.0, w=1.0, comm=0.0)
    schedule = make_schedule("zb-h1", stages=4, microbatches=8, costs=costs)
    times = {mode: r.step_time for mode, r in compare_step_times(schedule, costs, optimizer=0.5).items()}
    assert times["post-validation"] == pytest.approx(times["barrier"])


def test_the_barrier_shows_in_the_timeline_and_post_validation_has_none():
    schedule = _schedule("zb-h1")
    results = compare_step_times(schedule, COSTS, steps=3, optimizer=0.3)
    barrier, post = results["barrier"], results["post-validation"]
    assert {b.kind for b in barrier.boxes} == {"F", "I", "W", "AR", "OPT"}
    assert {b.kind for b in post.boxes} == {"F", "I", "W", "OPT"}
    # with the barrier every rank steps its optimizer at the same instant; without, they stagger
    def optimizer_starts(result):
        return {round(b.start, 9) for b in result.boxes if b.kind == "OPT" and b.action.startswith("step1:")}

    assert len(optimizer_starts(barrier)) == 1
    assert len(optimizer_starts(post)) == 4
    svg = to_svg(list(post.boxes), title="post-validation")
    assert svg.count('class="action OPT"') == 3 * 4


def test_bad_arguments():
    schedule = _schedule("1f1b")
    with pytest.raises(ValueError, match="mode"):
        simulate_steps(schedule, COSTS, "eventually")
    with pytest.raises(ValueError, match="steps"):
        simulate_steps(schedule, COSTS, steps=1)
