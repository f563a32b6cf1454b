"""The schedule a compile keeps, chosen by timing real steps (cuDNN's benchmark mode and
Inductor's autotuning choose kernels this way): a prediction from one short calibration is off
by more than the few percent the schedules differ by, so the candidates are run.

Entrants (`entrants`): the schedule zb-auto solved on the calibration's costs, the same with its
backwards fused again where the calibration's B makes that pay (`schedules/fusion.py`), zb-auto
solved on the compiler's static estimates (where it differs), and the handcrafted schedules of the same
placement that fit the same memory limit: 1F1B always (the safe incumbent), ZB-H1 and ZB-H2
where the compile has one stage per rank, ZBV where it is a V; where the pipeline follows
readiness (W run in waits for messages, `runtime/step/dispatch.py`), zb-auto's solve also in the
plan's order, since moving W is a prediction too (from recent waits). Schedules of one compile switch
freely between steps (the same stages on the same ranks, no state moves), and none changes what
a step computes, only when its work runs. Every entrant's `info["cost_source"]` is "measured",
its `info["costs"]` the calibration's: its predictions (`explain()`) are under those.

A round runs every entrant still in the race in turn (the order rotated round by round, so
that none always follows the same one): two steps each, the first settling the switch, the
second timed on every rank; a step's time is the longest of the pipeline's ranks'. From
`MIN_ROUNDS` rounds on, an entrant every timed step of which is slower than every timed step of
the fastest (by median) is out: it runs no more. The race stops once every other entrant is out
(the fastest leads by more than the spread), else after `rounds`; the fastest median wins. Each
round costs one gather over the pipeline and one broadcast; the decision is the deciding rank's
(`Layout.decides`), so every rank, replica and tensor-parallel rank keeps the same schedule. At
most 2 x `rounds` x entrants calibration steps (`pipeline(race_rounds=...)`, 0: keep zb-auto's
solve unraced).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from zbcompile.runtime.parallel.layout import Layout, from_first_rank, gather_objects
from zbcompile.schedules import Costs, Schedule, make_schedule, simulate
from zbcompile.schedules.fusion import fused_where_it_pays

MIN_ROUNDS = 2
IN_LINE_RIVALS = ("1f1b", "zb-h1", "zb-h2")  # where the compile runs one stage per rank
V_RIVALS = ("zbv",)  # where it runs a V of two chunks per rank


@dataclass
class Entrant:
    """One candidate schedule: its `label`, the time the simulator predicts for it under the
    calibration's costs, whether it follows readiness, and the seconds of its timed steps."""

    label: str
    schedule: Schedule
    predicted_s: float
    follow_readiness: bool = True
    samples: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    def record(self) -> dict[str, Any]:
        spread = (max(self.samples) - min(self.samples)) / 2 if self.samples else None
        return {
            "label": self.label, "predicted_step_s": self.predicted_s,
            "measured_step_s": self.median_s if self.samples else None, "spread_s": spread, "steps": len(self.samples),
        }


def entrants(
    solved: Schedule, costs: Costs, memory_limit: Any, static: Schedule | None = None, readiness: bool = False
) -> list[Entrant]:
    """zb-auto's `solved` schedule, it with backwards fused where `costs` (their B times) say that
    pays, zb-auto solved on the compiler's `static` estimates where
    given and different, and the handcrafted schedules of the placement that fit `memory_limit`
    (the limit it was solved under; None: none), each with its predicted step (the simulator's
    span under `costs`, the calibration's) and following `readiness`; with `readiness`, also
    `solved` in the plan's order where it has a W to move."""
    v = solved.stages == 2 * solved.ranks
    measured = {"cost_source": "measured", "costs": costs}
    found = [Entrant("zb-auto", solved, simulate(solved, costs).span)]
    if readiness and any(a.kind == "W" for row in solved.actions for a in row):
        found.append(Entrant("zb-auto (plan order)", solved, found[0].predicted_s, follow_readiness=False))
    fused = fused_where_it_pays(solved, costs, memory_limit)
    if fused is not solved:
        found.append(Entrant("zb-auto (fused B)", fused, simulate(fused, costs).span))
    if static is not None and static.placement == solved.placement and static.actions != solved.actions:
        predicted = simulate(static, costs).span
        found.append(Entrant("zb-auto (static costs)", static.with_info(**measured), predicted))
    for name in V_RIVALS if v else IN_LINE_RIVALS:
        try:
            rival = make_schedule(
                name, solved.stages, solved.microbatches, costs, memory_limit=memory_limit, ranks=solved.ranks
            )
        except ValueError:  # does not fit the limit
            continue
        if rival.placement == solved.placement:
            found.append(Entrant(name, rival.with_info(**measured), simulate(rival, costs).span))
    for entrant in found:
        entrant.follow_readiness = entrant.follow_readiness and readiness
    return found


def run_as(runner: Any, entrant: Entrant) -> None:
    """From its next step on, `runner` runs `entrant`'s schedule, following readiness or not as
    the entrant does."""
    runner.follow(entrant.follow_readiness)
    if entrant.schedule is not runner.schedule:
        runner.reschedule(entrant.schedule)


def still_in(entries: Sequence[Entrant], rounds_run: int) -> list[Entrant]:
    """The entrants that run in the next round: before `MIN_ROUNDS`, all; then the fastest (by
    median) and every one with a timed step as fast as one of the fastest's."""
    if rounds_run < MIN_ROUNDS or len(entries) < 2:
        return list(entries)
    best = min(entries, key=lambda e: e.median_s)
    return [e for e in entries if e is best or min(e.samples) <= max(best.samples)]


def decided(entries: Sequence[Entrant], rounds_run: int) -> bool:
    """Whether the race may stop: `MIN_ROUNDS` run and every timed step of the fastest (by
    median) faster than every timed step of each other entrant."""
    return len(entries) < 2 or (rounds_run >= MIN_ROUNDS and len(still_in(entries, rounds_run)) == 1)


def race(
    entries: list[Entrant], run_step: Callable[[Entrant], None], layout: Layout | None, rounds: int
) -> tuple[Entrant, dict[str, Any], list[Entrant]]:
    """Race `entries` (see the module docstring): `run_step(entrant)` runs one calibration step
    as `entrant` says. Returns the winner, the record `explain()` shows and the finalists (the
    entrants still in the race at its end, fastest median first; none unraced), the same on
    every rank."""
    rounds_run, running = 0, list(entries)
    while rounds_run < rounds and not decided(running, rounds_run):
        running, mine = still_in(running, rounds_run), {}
        for k in range(len(running)):
            entrant = running[(k + rounds_run) % len(running)]
            run_step(entrant)  # settles the switch
            started = time.perf_counter()
            run_step(entrant)
            mine[entrant.label] = time.perf_counter() - started
        gathered = gather_objects(mine, layout.pp_group) if layout is not None else [mine]
        times = from_first_rank([max(g[e.label] for g in gathered) for e in running], layout)
        for entrant, seconds in zip(running, times):
            entrant.samples.append(seconds)
        rounds_run += 1
    winner = min(running, key=lambda e: e.median_s) if rounds_run else entries[0]
    why = f"fastest measured over {rounds_run} round(s)"
    if decided(running, rounds_run) and len(entries) > 1:
        why += ", ahead of every other beyond the spread"
    finalists = sorted(still_in(running, rounds_run), key=lambda e: e.median_s) if rounds_run else []
    return winner, {"entrants": [e.record() for e in entries], "chosen": winner.label, "why": why}, finalists
