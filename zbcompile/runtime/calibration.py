"""The first compile's choices, made on calibration steps of its batch and checked on real steps:
the cut (`runtime/recut.py` measures and predicts) and the schedule (`runtime/schedule_race.py`).

A re-cut is a prediction from one short calibration, and on a shared machine such a prediction
can be off by more than the gain it promises. So where the decision moves the cut, the new cut's
schedules race the compiler's cut on real steps: zb-auto solved on the compiler's cut's
measured costs, and the safe incumbent there (1F1B; ZBV where the compiler's cut is a V). When
the race switches between the two cuts, the parameters, gradients and buffers move between the
ranks (`state_transfer.py`, the same moves a re-cut makes); they are the same tensors either way
(no optimizer exists yet, and `untouched` puts gradients and buffers back), so which cut runs a
step changes when work runs, not what it computes. The cut of the fastest entrant stays: a
re-cut measured slower than the compiler's cut is undone, and `explain()` says so. Where the cut
stays, its schedules race as before (zb-auto on measured and on static costs, the handcrafted
ones).

The cost: the race's steps (2 per entrant still in the race per round, `race_rounds` rounds)
and, where the cut changes, up to two moves of the state per round and one back at the end;
none with `race_rounds=0`, which trusts the prediction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zbcompile.runtime import recut, schedule_race
from zbcompile.runtime.layout import from_first_rank
from zbcompile.schedules import Costs

Builder = Any  # runtime/build.py's Builder (it calls this module): its layout, options, choice, state
Build = Any  # runtime/build.py's Build: one compile's runner and tuner

COMPILER_CUT = " (compiler's cut)"  # the label's tail of the compiler's cut's entrants in a re-cut race
INCUMBENTS = ("zb-auto", "1f1b", "zbv")  # the compiler's cut's entrants there (1F1B in-line, ZBV in a V)


def calibrated(builder: Builder, built: Build, micro_inputs: list, micro_targets: list, absent: tuple) -> Build:
    """`built` (the compiler's cut) after calibration steps on this batch: the compile, at the
    compiler's cut or the one chosen by measurement, whose schedule measured fastest on real
    steps, with the state where its ranks read it (see the module docstring)."""
    runner, layout = built.runner, builder.layout()
    batch = (micro_inputs, micro_targets, absent)

    def train() -> None:
        runner.train(*batch, builder.ownership)

    doubt = recut.speeds_in_doubt(built.compiled, runner.schedule)
    with recut.untouched(builder.module, runner.device):
        gathered = recut.calibrate(runner, train, builder.options.profile_steps, layout, doubt)
    choice = None
    if layout.decides:
        reduction = list(builder.choice.reduction_per_message(built.compiled))
        choice = recut.decide(built.compiled, runner.schedule, gathered, builder.options, reduction)
    choice = from_first_rank(choice, layout)
    static = runner.schedule  # solved on the compiler's estimates
    measured = choice.current_costs if choice.changes else choice.costs  # the compiler's cut's
    compiler_costs = recut.solve_costs(measured, built.compiled)
    runner.reschedule(builder.choice.schedule(built.compiled, costs=compiler_costs))
    if choice.changes:
        try:
            rebuilt = builder.compile_at(built, choice, (micro_inputs[0], micro_targets[0]))
        except ValueError as error:  # the model does not compile at that cut (on every rank alike)
            choice = recut.kept(choice, built.compiled, static, str(error).splitlines()[0])
        else:
            return _recut_raced(builder, built, rebuilt, choice, compiler_costs, batch)
    field = _entrants(builder, built, compiler_costs, static)
    winner, race = _race(builder, field, dict.fromkeys([e.label for e in field], built), built, batch)
    return _finished(builder, built, choice, compiler_costs, winner, race)


def _recut_raced(
    builder: Builder, built: Build, rebuilt: Build, choice: recut.CutChoice, compiler_costs: Costs, batch: tuple
) -> Build:
    """The re-cut `rebuilt` (holding the state now) raced against the compiler's cut `built`:
    the winner's compile, the state moved back to `built` where it won."""
    new_costs = recut.solve_costs(choice.costs, rebuilt.compiled)
    field = _entrants(builder, rebuilt, new_costs)
    homes = {e.label: rebuilt for e in field}
    for entrant in _entrants(builder, built, compiler_costs):
        if entrant.label in INCUMBENTS:
            entrant.label += COMPILER_CUT
            field.append(entrant)
            homes[entrant.label] = built
    winner, race = _race(builder, field, homes, rebuilt, batch)
    if homes[winner.label] is rebuilt:
        rebuilt.tuner.history.append({"step": 0, "event": f"re-cut at compile: {choice.cut} (raced on real steps)"})
        return _finished(builder, rebuilt, choice, new_costs, winner, race)
    builder.move_state(rebuilt, built)
    slower = f"the re-cut to {choice.cut} measured slower on real steps than the compiler's cut"
    choice = recut.kept(choice, built.compiled, built.runner.schedule, slower)
    return _finished(builder, built, choice, compiler_costs, winner, race)


def _finished(
    builder: Builder, built: Build, choice: recut.CutChoice, costs: Costs, winner: schedule_race.Entrant, race: dict
) -> Build:
    """`built` running the race's `winner` at `choice`'s cut, solved on `costs`: the builder
    keeps the cut and costs, the compile its record, the tuner starts from them."""
    builder.cut_choice, builder.measured_costs = choice, costs
    built.runner.compiled = replace(built.runner.compiled, cut_record={**choice.record, "race": race})
    built.tuner.calibrated(costs, winner.schedule, f"raced at compile: {race['chosen']} kept")
    return built


def _entrants(builder: Builder, built: Build, costs: Costs, static: Any = None) -> list[schedule_race.Entrant]:
    """`built`'s entrants (`schedule_race.entrants`) around the schedule it runs, solved on `costs`."""
    solved = built.runner.schedule
    return schedule_race.entrants(
        solved, costs, solved.info.get("memory_limit"), static, builder.options.follow_readiness
    )


def _race(
    builder: Builder, field: list, homes: dict[str, Build], holding: Build, batch: tuple
) -> tuple[schedule_race.Entrant, dict]:
    """Race `field` on steps of `batch` (microbatch inputs, targets, the parts absent here), each
    entrant on its compile in `homes` (`holding` holds the state now), inside `untouched`, the
    state back in `holding` at the end; the winner then runs on its compile."""
    where = [holding]

    def run_step(entrant: schedule_race.Entrant) -> None:
        home = homes[entrant.label]
        if home is not where[0]:
            builder.move_state(where[0], home)
            where[0] = home
        schedule_race.run_as(home.runner, entrant)
        home.runner.train(*batch, builder.ownership)

    with recut.untouched(builder.module, holding.runner.device):
        winner, race = schedule_race.race(field, run_step, builder.layout(), builder.options.race_rounds)
        if where[0] is not holding:  # what `untouched` puts back is what `holding` holds
            builder.move_state(where[0], holding)
    schedule_race.run_as(homes[winner.label].runner, winner)
    return winner, race
