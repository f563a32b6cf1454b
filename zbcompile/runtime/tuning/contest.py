"""The contest every measured choice goes through: candidate schedules run on paired, interleaved
rounds of real steps, and a sequential decision reads the paired per-round ratios (cuDNN's
benchmark mode and Inductor's autotuning choose kernels by running them too: a prediction from
one short calibration is off by more than the few percent the schedules differ by).

Entrants (`entrants`): the schedule zb-auto solved on the calibration's costs, the same with its
backwards fused again where the calibration's B makes that pay (`schedules/fusion.py`), zb-auto
solved on the compiler's static estimates (where it differs), and the handcrafted schedules of the
same placement that fit the same memory limit: 1F1B always, ZB-H1 and ZB-H2 where the compile has
one stage per rank, ZBV where it is a V; where the pipeline follows readiness (W run in waits for
messages, `runtime/step/dispatch.py`), zb-auto's solve also in the plan's order. None changes what
a step computes, only when its work runs. Every entrant's `info["costs"]` is the calibration's.

A round runs every entrant still in, in an order rotated round by round, each as a block of two
steps: the first settles the switch (and absorbs a first run's compile or warm-up: never timed),
the second is timed on every rank; a step's time is the longest rank's. Rounds pair the entrants:
the machine's speed drifts between rounds more than schedules differ, so entrants are compared by
their per-round ratios, never step against step across rounds (`leads`: a one-sided t bound on
the mean log ratio). From `MIN_ROUNDS` rounds on, an entrant the leader (the least median step)
`leads` runs no more; the contest is decided once one entrant is left, and otherwise ends with its
budget of rounds, where the leader wins: the better measured median, whoever the incumbent.

`race` runs it on calibration steps (the first compile: `calibration.py`, its entrants on up to
three cuts); `ScheduleTrial` on the training's own steps (a re-solved schedule against the running
one, or the race's finalists where it ended undecided: `schedule_trial.ScheduleSwitch`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from time import perf_counter  # the contest's clock (replaced in tests)
from typing import Any, Callable, Sequence

from zbcompile.runtime.parallel.layout import Layout, from_first_rank, gather_objects
from zbcompile.schedules import Costs, Schedule, make_schedule, simulate
from zbcompile.schedules.fusion import fused_where_it_pays

MIN_ROUNDS = 2
IN_LINE_RIVALS = ("1f1b", "zb-h1", "zb-h2")  # where the compile runs one stage per rank
V_RIVALS = ("zbv",)  # where it runs a V of two chunks per rank
# one-sided 95% quantiles of Student's t by degrees of freedom (1..10; beyond: the normal's)
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)


@dataclass
class Entrant:
    """One candidate schedule: its `label`, the time the simulator predicts for it under the
    calibration's costs, whether it follows readiness, and the seconds of its timed steps (one per
    round it ran, from the contest's first round on)."""

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


def ratios(entrant: Entrant, other: Entrant) -> list[float]:
    """`entrant`'s timed step over `other`'s, round by round, over the rounds both ran."""
    return [mine / theirs for mine, theirs in zip(entrant.samples, other.samples)]


def leads(entrant: Entrant, other: Entrant) -> bool:
    """Whether `entrant` is faster than `other` with 95% confidence on their paired rounds (at
    least `MIN_ROUNDS`): the one-sided t bound of the mean log ratio below 0."""
    logs = [math.log(r) for r in ratios(entrant, other)]
    if len(logs) < MIN_ROUNDS:
        return False
    mean = statistics.fmean(logs)
    spread = statistics.stdev(logs) / math.sqrt(len(logs))
    quantile = _T95[len(logs) - 2] if len(logs) - 1 <= len(_T95) else 1.645
    return mean + quantile * spread < 0


def leader(entries: Sequence[Entrant]) -> Entrant:
    """The entrant of the least median step (the first on a tie)."""
    return min(entries, key=lambda e: e.median_s)


def still_in(entries: Sequence[Entrant], rounds_run: int) -> list[Entrant]:
    """The entrants of the next round: before `MIN_ROUNDS`, all; then the leader and every one it
    does not lead with confidence."""
    if rounds_run < MIN_ROUNDS or len(entries) < 2:
        return list(entries)
    best = leader(entries)
    return [e for e in entries if e is best or not leads(best, e)]


def decided(entries: Sequence[Entrant], rounds_run: int) -> bool:
    """Whether the contest may stop: one entrant left (`still_in`)."""
    return len(entries) < 2 or (rounds_run >= MIN_ROUNDS and len(still_in(entries, rounds_run)) == 1)


def round_times(mine: dict[str, float], entries: Sequence[Entrant], layout: Layout | None) -> list[float]:
    """Each entrant's timed step of a round on every rank of the pipeline: the longest rank's, the
    deciding rank's reading (one gather, one broadcast)."""
    gathered = gather_objects(mine, layout.pp_group) if layout is not None else [mine]
    return from_first_rank([max(g[e.label] for g in gathered) for e in entries], layout)


def entrants(
    solved: Schedule, costs: Costs, memory_limit: Any, static: Schedule | None = None, readiness: bool = False
) -> list[Entrant]:
    """zb-auto's `solved` schedule, it with backwards fused where `costs` (their B times) say that
    pays, zb-auto solved on the compiler's `static` estimates where given and different, and the
    handcrafted schedules of the placement that fit `memory_limit` (the limit it was solved under;
    None: none), each with its predicted step (the simulator's span under `costs`) and following
    `readiness`; with `readiness`, also `solved` in the plan's order where it has a W to move."""
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


def _why(entries: Sequence[Entrant], rounds_run: int) -> str:
    """How the contest over `entries` was decided after `rounds_run` rounds."""
    if decided(entries, rounds_run) and len(entries) > 1:
        return f"faster than every other with 95% confidence on paired rounds, after {rounds_run} round(s)"
    return f"the least median step over {rounds_run} round(s), undecided on paired rounds"


def race(
    entries: list[Entrant], run_step: Callable[[Entrant], None], layout: Layout | None, rounds: int
) -> tuple[Entrant, dict[str, Any], list[Entrant]]:
    """The contest on calibration steps (module docstring): `run_step(entrant)` runs one step as
    `entrant` says. Returns the winner, the record `explain()` shows and the finalists (the
    entrants still in at its end, fastest median first; none unraced), the same on every rank."""
    rounds_run, running = 0, list(entries)
    while rounds_run < rounds and not decided(running, rounds_run):
        running, mine = still_in(running, rounds_run), {}
        for k in range(len(running)):
            entrant = running[(k + rounds_run) % len(running)]
            run_step(entrant)  # settles the switch
            started = perf_counter()
            run_step(entrant)
            mine[entrant.label] = perf_counter() - started
        for entrant, seconds in zip(running, round_times(mine, running, layout)):
            entrant.samples.append(seconds)
        rounds_run += 1
    if not rounds_run:
        return entries[0], {"entrants": [e.record() for e in entries], "chosen": entries[0].label,
                            "why": "unraced"}, []
    winner = leader(running)
    record = {"entrants": [e.record() for e in entries], "chosen": winner.label,
              "why": _why(running, rounds_run)}
    return winner, record, sorted(still_in(running, rounds_run), key=lambda e: e.median_s)


BLOCK_STEPS = 2  # per entrant and round: one settling step, one timed


class ScheduleTrial:
    """The contest on the training's own steps: `entrants` in the order their blocks run, the first
    from the next step on (its caller switches it in); `incumbent`, one of them, the ratios'
    reference in the record. Each runs with the stage programs `programs` gives (label -> compiled
    pipeline; absent or None: the runner's own, unchanged). Every rank of the pipeline calls
    `after_step` after each step; the time of a step is the time since the previous one ended."""

    def __init__(
        self, entrants: Sequence[Entrant], incumbent: Entrant, rounds: int, programs: dict[str, Any] | None = None
    ) -> None:
        self.entrants = list(entrants)
        self.incumbent = incumbent
        self.rounds = max(rounds, MIN_ROUNDS)
        self.programs = programs or {}
        self.rounds_run = 0
        self._turn = 0  # the block's place in this round's order
        self._step = 0  # the step's place in its block
        self._mine: dict[str, float] = {}  # this round's timed steps on this rank, by label
        self._last = perf_counter()

    @property
    def running(self) -> Entrant:
        return self.entrants[(self._turn + self.rounds_run) % len(self.entrants)]

    def after_step(self, layout: Any, scale: float = 1.0) -> Entrant | None:
        """Record the step just run (`scale`: how much more work its sizes are than the compile's
        example, `CompiledPipeline.step_scale`; its time counts divided by it); returns the entrant
        to run from the next step on where it changes (None: keep the running one). `finished`
        tells when the trial has ended."""
        now = perf_counter()
        seconds, self._last = (now - self._last) / scale, now
        self._step += 1
        if self._step < BLOCK_STEPS:
            return None
        before = self.running
        self._mine[before.label] = seconds
        self._step, self._turn = 0, self._turn + 1
        if self._turn == len(self.entrants):
            for entrant, taken in zip(self.entrants, round_times(self._mine, self.entrants, layout)):
                entrant.samples.append(taken)
            self._mine, self._turn = {}, 0
            self.rounds_run += 1
        after = self.winner if self.finished else self.running
        return after if after is not before else None

    @property
    def finished(self) -> bool:
        return self.rounds_run >= self.rounds or decided(self.entrants, self.rounds_run)

    @property
    def winner(self) -> Entrant:
        """The leader (the least median step; the incumbent on a tie) once a round has run; the
        incumbent before."""
        if not self.rounds_run:
            return self.incumbent
        return min(self.entrants, key=lambda e: (e.median_s, e is not self.incumbent))

    def record(self) -> dict[str, Any]:
        """What `explain()` shows: every entrant's predicted and measured steps, the choice and why,
        and each entrant's median ratio to the incumbent."""
        winner = self.winner
        paired = {e.label: statistics.median(ratios(e, self.incumbent)) for e in self.entrants if e.samples}
        return {"entrants": [e.record() for e in self.entrants], "chosen": winner.label,
                "why": _why(self.entrants, self.rounds_run), "ratio_to_incumbent": paired}
