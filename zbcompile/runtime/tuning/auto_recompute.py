"""recompute="auto": per stage, the recompute level (`passes/recompute.py`: elementwise ops,
then normalisations and reductions, then everything; W keeping, recomputing or not deferring
what it needs) under which the schedule fits the memory limit in the least simulated time.

Starting with no recomputation: while some ranks exceed their limit, each stage on such a rank
takes, among its levels, the one whose schedule fits its rank in the least simulated time (the
other stages as they are), or, where none fits, the one that lowers its rank's peak most. Once
all fit, each stage in turn moves to the level that keeps every rank within its limit in less
simulated time, until none does: a schedule solved under the limit (zb-auto) may fit with no
recomputation only by giving up overlap, and run faster with some. Each
candidate's schedule is solved and simulated (`evaluate_memory`) with the limit in the memory unit
of the pipeline before recomputation, which the candidates keep. A rank fits when its peak with
each action's own transients (`CompiledPipeline.peak_memory_with_transients`: the values a
backward recomputes live inside it) is within the limit: the memory the runtime measures.

At compile the candidates are weighed with static costs; `MeasuredRecomputation` weighs them
again with measured ones when zb-auto re-solves with those (`profile.CostTuner`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

from zbcompile.compiler import CompiledPipeline
from zbcompile.schedules import Costs, make_schedule
from zbcompile.schedules.costs import fits_memory
from zbcompile.schedules.simulate import simulate
from zbcompile.schedules.validate import rank_limits


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A candidate's schedule: the stages whose rank exceeds its limit, each stage's rank peak
    (bytes) and the simulated makespan."""

    over: frozenset[int]
    stage_peaks: tuple[float, ...]
    makespan: float


def evaluate_memory(
    compiled: CompiledPipeline,
    solve_arguments: Callable[[Costs, CompiledPipeline], dict[str, Any]],
    costs_of: Callable[[CompiledPipeline], Costs] = CompiledPipeline.schedule_costs,
) -> Evaluation:
    """The schedule for `compiled`'s costs (`costs_of(compiled)`: by default the static ones;
    `solve_arguments(costs, compiled)`: the limit in `compiled`'s memory unit; zb-auto: its
    heuristic, no solver time), evaluated: the stages whose rank exceeds its limit, each stage's
    rank peak in bytes, the simulated makespan."""
    costs = costs_of(compiled)
    arguments = {**solve_arguments(costs, compiled), "time_budget": 0}
    try:
        schedule = make_schedule(**arguments)
    except ValueError:  # the limit cannot be met (validation or the solver said so)
        schedule = make_schedule(**{**arguments, "memory_limit": None})
    limits = rank_limits(arguments["memory_limit"], len(schedule.actions))
    peaks = compiled.peak_memory_with_transients(schedule, costs)
    over = frozenset(
        s for s, r in enumerate(schedule.stage_to_rank) if limits is not None and not fits_memory(peaks[r], limits[r])
    )
    unit = compiled.memory_unit()
    return Evaluation(over, tuple(peaks[r] * unit for r in schedule.stage_to_rank), simulate(schedule, costs).makespan)


def with_levels(compiled: CompiledPipeline, levels: Sequence[int]) -> CompiledPipeline:
    """`compiled` running stage s at recompute level `levels[s]` (its memory unit kept)."""
    unit = compiled.memory_unit()
    programs = tuple(options[level] for options, level in zip(compiled.alternatives, levels))
    return dataclasses.replace(compiled, programs=programs, recompute_levels=tuple(levels), memory_unit_bytes=unit)


def choose_recomputation(
    compiled: CompiledPipeline, evaluate: Callable[[CompiledPipeline], Evaluation]
) -> CompiledPipeline:
    """The levels chosen as the module docstring says. Raises ValueError naming the stages that
    exceed the limit at every level."""
    if not compiled.alternatives:
        raise ValueError("recompute='auto' needs a pipeline compiled with recompute alternatives")
    levels = [0] * len(compiled.programs)
    for _ in range(sum(len(options) for options in compiled.alternatives)):
        current = evaluate(with_levels(compiled, levels))
        if not current.over:
            return with_levels(compiled, _fastest_fitting(compiled, levels, current.makespan, evaluate))
        changed = False
        for stage in sorted(current.over):
            best = _best_level(compiled, levels, stage, current, evaluate)
            changed |= best != levels[stage]
            levels[stage] = best
        if not changed:
            break
    over = sorted(evaluate(with_levels(compiled, levels)).over)
    raise ValueError(
        f"recompute='auto': stages {over} exceed the memory limit at every recompute level (their backward recomputing "
        "every forward value, W holding nothing); raise memory_limit or use more stages"
    )


def _fastest_fitting(compiled: CompiledPipeline, levels: list[int], makespan: float, evaluate) -> list[int]:
    """From `levels`, under which every rank fits: stage by stage, the level under which every
    rank still fits in less simulated time, until no stage has one."""
    improved = True
    while improved:
        improved = False
        for stage, options in enumerate(compiled.alternatives):
            for level in range(len(options)):
                trial_levels = [level if s == stage else v for s, v in enumerate(levels)]
                trial = evaluate(with_levels(compiled, trial_levels))
                if not trial.over and trial.makespan < makespan * (1 - 1e-9):
                    levels, makespan, improved = trial_levels, trial.makespan, True
    return levels


def _best_level(compiled: CompiledPipeline, levels: list[int], stage: int, current: Evaluation, evaluate) -> int:
    """The level of `stage` that fits its rank in the least time, else the one with the lowest
    peak below the current one (else the current level)."""
    fitting, lowest = None, (current.stage_peaks[stage], levels[stage])
    for level in range(len(compiled.alternatives[stage])):
        trial = evaluate(with_levels(compiled, [level if s == stage else v for s, v in enumerate(levels)]))
        if stage not in trial.over:
            fitting = min(fitting or (trial.makespan, level), (trial.makespan, level))
        elif trial.stage_peaks[stage] < lowest[0]:
            lowest = (trial.stage_peaks[stage], level)
    return fitting[1] if fitting is not None else lowest[1]


def calibrated_costs(running: CompiledPipeline, measured: Costs, candidate: CompiledPipeline) -> Costs:
    """`candidate`'s costs (the same compile at other levels) predicted from `measured`, the costs
    measured running `running`'s levels: a stage at its running level keeps its measured times;
    at another level, its static estimates scaled by its measured / static ratio, one for F and
    one for the backward (I + W together: levels move work between I and W). Memory: the
    candidate's static estimates; comm: measured."""
    static, predicted = running.schedule_costs(), candidate.schedule_costs()
    times = {"f": [], "i": [], "w": []}
    for s, (ran, level) in enumerate(zip(running.recompute_levels, candidate.recompute_levels)):
        if ran == level:
            for kind in times:
                times[kind].append(getattr(measured, kind)[s])
            continue
        forward = _ratio([measured.f[s]], [static.f[s]])
        backward = _ratio([measured.i[s], measured.w[s]], [static.i[s], static.w[s]])
        times["f"].append(predicted.f[s] * forward)
        times["i"].append(predicted.i[s] * backward)
        times["w"].append(predicted.w[s] * backward)
    return Costs(**times, comm=measured.comm, mem_b=predicted.mem_b, mem_w=predicted.mem_w)


def _ratio(measured: Sequence[float], static: Sequence[float]) -> float:
    return sum(measured) / sum(static) if sum(static) > 0 else 1.0


class MeasuredRecomputation:
    """recompute="auto" chosen again with measured costs (`profile.CostTuner`, when zb-auto
    re-solves with them): `choose(measured)` runs `choose_recomputation` under the same limit
    (`solve_arguments`) with every candidate's costs calibrated from `measured`
    (`calibrated_costs`); `use(levels)` makes those levels the running ones and returns the
    pipeline to run (`finish`: its stage programs compiled as the options say)."""

    def __init__(
        self,
        running: CompiledPipeline,
        solve_arguments: Callable[[Costs, CompiledPipeline], dict[str, Any]],
        finish: Callable[[CompiledPipeline], CompiledPipeline] = lambda compiled: compiled,
    ) -> None:
        self.running = running
        self.solve_arguments = solve_arguments
        self.finish = finish

    @property
    def levels(self) -> tuple[int, ...]:
        return self.running.recompute_levels

    def choose(self, measured: Costs) -> tuple[tuple[int, ...], Costs]:
        """The levels under which the schedule fits the limit in the least simulated time with
        `measured` (the running levels' costs), and their calibrated costs. Raises ValueError
        where no level fits."""

        def costs_of(candidate: CompiledPipeline) -> Costs:
            return calibrated_costs(self.running, measured, candidate)

        evaluate = functools.partial(evaluate_memory, solve_arguments=self.solve_arguments, costs_of=costs_of)
        chosen = choose_recomputation(self.running, evaluate)
        return chosen.recompute_levels, costs_of(chosen)

    def use(self, levels: Sequence[int]) -> CompiledPipeline:
        """The running pipeline at `levels` (its stage programs finished), from now on."""
        if tuple(levels) != self.levels:
            self.running = self.finish(with_levels(self.running, levels))
        return self.running
