"""The first compile's choices, made on calibration steps of its batch and checked on real steps:
the cut (`runtime/tuning/recut.py` measures and predicts) and the schedule (`contest.py`).

A cut decision is a prediction from one short calibration, and on a shared machine such a
prediction can be off by more than the gain it promises, or than the few percent between one
stage per rank and a V. So up to three cuts go through one contest on real steps: the chosen one
with its schedules (zb-auto's solves and the handcrafted ones of its placement); where it moved,
the compiler's cut (zb-auto solved on its measured costs and its safe incumbent, 1F1B, or ZBV
where it is a V); and the decision's rival (`CutChoice.rival`: the best-predicted cut of the
placement neither of those has, with zb-auto and its incumbent). When the contest switches
between cuts, the parameters, gradients and buffers move between the ranks (`state_transfer.py`,
the moves a re-cut makes); they are the same tensors either way (no optimizer exists yet, and
`untouched` puts gradients and buffers back), so which cut runs a step changes when work runs, not
what it computes. The contest's winner keeps its cut, whichever it is: decided on paired rounds
with confidence, or, where its rounds run out undecided, by the least median step (never the
compiler's cut by default); `explain()` says which.

The race times few steps of one batch, without the optimizer's step between them; where it ends
undecided, up to `FINALISTS` of its finalists on the winning cut (the entrants still in at its end)
go on through the same contest on the training's own steps (`CostTuner.calibrated`,
`contest.ScheduleTrial`), where no state moves.

The cost: the race's steps (2 per entrant still in the race per round, `race_rounds` rounds), a
compile per cut raced, and up to two moves of the state per cut and round; then the finalists'
trial, up to 2 x `race_rounds` training steps each. `race_rounds=0` trusts the prediction (no race,
no rival, no trial).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from zbcompile.options import PipelineOptions
from zbcompile.runtime.parallel.layout import Layout, from_first_rank
from zbcompile.runtime.state.state_ownership import StateOwnership
from zbcompile.runtime.tuning import contest, recut
from zbcompile.runtime.tuning.schedule_choice import ScheduleChoice
from zbcompile.schedules import Costs


class Build(Protocol):
    """One compile (`runtime/build.Build`): its runner (schedule, compiled stages) and cost tuner."""

    runner: Any
    tuner: Any

    @property
    def compiled(self) -> Any: ...


class Assembly(Protocol):
    """What makes compiles at other cuts (`runtime/build.Assembly`)."""

    def compile_at(self, built: Build, choice: recut.CutChoice, example: tuple) -> Build: ...

    def move_state(self, source: Build, target: Build) -> None: ...


class Builder(Protocol):
    """What the first compile's choices read and set of the pipeline (`runtime/build.Builder`)."""

    module: torch.nn.Module
    options: PipelineOptions
    ownership: StateOwnership
    choice: ScheduleChoice
    assembly: Assembly
    cut_choice: recut.CutChoice | None
    measured_costs: Costs | None

    def layout(self) -> Layout: ...


COMPILER_CUT = "compiler's cut"  # how the compiler's cut's entrants are labelled beside a re-cut
INCUMBENTS = ("zb-auto", "1f1b", "zbv")  # the entrants of a cut raced beside the chosen one
FINALISTS = 3  # at most this many of the race's finalists are tried again on the training's steps


@dataclass
class _Contender:
    """A cut in the race: its compile, the choice the pipeline keeps where it wins, the costs its
    schedules are solved on, and how its entrants' labels end (None: the chosen cut's, unmarked)."""

    build: Build
    choice: recut.CutChoice
    costs: Costs
    tag: str | None = None


def calibrated(builder: Builder, built: Build, micro_inputs: list, micro_targets: list, absent: tuple) -> Build:
    """`built` (the compiler's cut) after calibration steps on this batch: the compile, at the
    compiler's cut or another one measured, whose schedule measured fastest on real steps, with
    the state where its ranks read it (see the module docstring)."""
    runner, layout = built.runner, builder.layout()
    batch = (micro_inputs, micro_targets, absent)

    def train() -> None:
        runner.train(*batch, builder.ownership)

    doubt = recut.speeds_in_doubt(built.compiled, runner.schedule)
    with recut.untouched(builder.module, runner.device):
        raced = builder.options.race_rounds > 0  # where B's time may bring a fused entrant
        gathered = recut.calibrate(runner, train, builder.options.profile_steps, layout, doubt, fused_b=raced)
    choice = None
    if layout.decides:
        reduction = list(builder.choice.reduction_per_message(built.compiled))
        choice = recut.decide(built.compiled, runner.schedule, gathered, builder.options, reduction)
    choice = from_first_rank(choice, layout)
    static = runner.schedule  # solved on the compiler's estimates
    measured = choice.current_costs if choice.changes else choice.costs  # the compiler's cut's
    compiler = _Contender(built, choice, recut.solve_costs(measured, built.compiled))

    def solve_at_the_compilers_cut() -> None:
        runner.reschedule(builder.choice.schedule(built.compiled, costs=compiler.costs))

    if not choice.changes or builder.options.race_rounds > 0:  # else it never runs
        solve_at_the_compilers_cut()
    example = (micro_inputs[0], micro_targets[0])
    chosen = holding = compiler  # the chosen cut's contender; the one holding the state
    others = []
    if choice.changes:
        slower = f"the re-cut to {choice.cut} was not measured faster on real steps than the compiler's cut"
        compiler.choice, compiler.tag = recut.kept(choice, built.compiled, static, slower), COMPILER_CUT
        try:
            chosen = holding = _compiled_at(builder, built, choice, example)
        except ValueError as error:  # the model does not compile at that cut (on every rank alike)
            choice = compiler.choice = recut.kept(choice, built.compiled, static, str(error).splitlines()[0])
            compiler.tag = None
            if builder.options.race_rounds == 0:
                solve_at_the_compilers_cut()
        else:
            others.append(compiler)
    if choice.rival is not None and builder.options.race_rounds > 0:
        rival = choice.to_rival(f"raced: {choice.rival[0]} measured fastest on real steps")
        try:
            holding = _compiled_at(builder, holding.build, rival, example, str(rival.cut))
        except ValueError:  # the rival does not compile there: it does not race
            pass
        else:
            others.append(holding)
    return _raced(builder, chosen, others, holding, static if chosen is compiler else None, batch)


def _compiled_at(
    builder: Builder, holding: Build, choice: recut.CutChoice, example: tuple, tag: str | None = None
) -> _Contender:
    """The model compiled at `choice`'s cut, the state moved there from `holding`."""
    build = builder.assembly.compile_at(holding, choice, example)
    return _Contender(build, choice, recut.solve_costs(choice.costs, build.compiled), tag)


def _raced(
    builder: Builder, chosen: _Contender, others: list[_Contender], holding: _Contender, static: Any, batch: tuple
) -> Build:
    """The compile whose schedule won the contest: `chosen`'s entrants (with its solve on `static`
    costs where given) against the incumbents of each of `others` (`holding` holds the state now),
    the state moved to the winner's cut."""
    field = _entrants(builder, chosen, static)
    homes = dict.fromkeys([e.label for e in field], chosen)
    for other in others:
        for entrant in _entrants(builder, other, only=INCUMBENTS):
            field.append(entrant)
            homes[entrant.label] = other
    winner, race, finalists = _race(builder, field, homes, holding, batch)
    won = homes[winner.label]
    contest.run_as(won.build.runner, winner)
    if won is not holding:
        builder.assembly.move_state(holding.build, won.build)
    build, choice = won.build, won.choice
    if choice.changes:
        build.tuner.history.append({"step": 0, "event": f"re-cut at compile: {choice.cut} (raced on real steps)"})
    builder.cut_choice, builder.measured_costs = choice, won.costs
    build.runner.compiled = replace(build.runner.compiled, cut_record={**choice.record, "race": race})
    # the one running first (the trial's incumbent); a decided race leaves no other finalist
    finalists = _distinct([winner, *(e for e in finalists if homes[e.label] is won and e is not winner)])[:FINALISTS]
    build.tuner.calibrated(won.costs, winner.schedule, f"raced at compile: {race['chosen']} kept", finalists)
    return build


def _distinct(entrants: list[contest.Entrant]) -> list[contest.Entrant]:
    """`entrants` less those that run as an earlier one does (the same actions, readiness alike)."""
    by_run: dict[tuple, contest.Entrant] = {}
    for entrant in entrants:
        by_run.setdefault((entrant.schedule.actions, entrant.follow_readiness), entrant)
    return list(by_run.values())


def _entrants(
    builder: Builder, contender: _Contender, static: Any = None, only: tuple[str, ...] | None = None
) -> list[contest.Entrant]:
    """`contender`'s entrants (`contest.entrants`, those labelled as in `only` where given)
    around the schedule its compile runs, solved on its costs, labelled with its tag."""
    solved = contender.build.runner.schedule
    found = contest.entrants(
        solved, contender.costs, solved.info.get("memory_limit"), static, builder.options.follow_readiness
    )
    found = [e for e in found if only is None or e.label in only]
    for entrant in found if contender.tag else ():
        entrant.label += f" ({contender.tag})"
    return found


def _race(
    builder: Builder, field: list, homes: dict[str, _Contender], holding: _Contender, batch: tuple
) -> tuple[contest.Entrant, dict, list[contest.Entrant]]:
    """Race `field` on steps of `batch` (microbatch inputs, targets, the parts absent here), each
    entrant on its cut's compile (`homes`; `holding` holds the state now), inside `untouched`,
    the state back in `holding` at the end. Returns `contest.race`'s winner, record and
    finalists."""
    where = [holding.build]

    def run_step(entrant: contest.Entrant) -> None:
        home = homes[entrant.label].build
        if home is not where[0]:
            builder.assembly.move_state(where[0], home)
            where[0] = home
        contest.run_as(home.runner, entrant)
        home.runner.train(*batch, builder.ownership)

    with recut.untouched(builder.module, holding.build.runner.device):
        winner, race, finalists = contest.race(field, run_step, builder.layout(), builder.options.race_rounds)
        if where[0] is not holding.build:  # what `untouched` puts back is what `holding` holds
            builder.assembly.move_state(where[0], holding.build)
    return winner, race, finalists
