"""Schedules tried on the training's own steps before one is kept (`profile.CostTuner`): a
schedule the tuner solves while training goes on against the running one (the solve's
prediction comes from the same measured costs that may be off by more than the gain it
promises), and the finalists of the compile's race, which timed calibration steps of one batch,
few and without the optimizer's step between them.

The entrants alternate over the training's steps, in blocks of two (the first settles the
switch, the second is timed: the time since the previous step ended, on every rank; a step's
time is the longest rank's). A round is one block of each, the order rotated round by round;
after each round one gather over the pipeline. The trial ends as the compile's race does
(`schedule_race.decided`: every timed step of the fastest beat every one of each other's,
after `schedule_race.MIN_ROUNDS`) or after its rounds (at least `MIN_ROUNDS`). Another entrant
replaces the incumbent only on a lead beyond the noise: faster than the incumbent in every round,
each round's two steps compared with each other (the machine's speed drifts between rounds, and
one step's time varies by more than the entrants differ); of several such, the one with the
least median ratio to the incumbent. Else the incumbent stays. Where an entrant brings other
stage programs (recompute levels chosen again), each switch runs that entrant's programs; none
changes what a step computes.
"""

from __future__ import annotations

import statistics
from time import perf_counter
from typing import Any, Sequence

from zbcompile.runtime.parallel.layout import from_first_rank, gather_objects
from zbcompile.runtime.tuning.schedule_race import MIN_ROUNDS, Entrant, decided

BLOCK_STEPS = 2  # per entrant and round: one settling step, one timed


class ScheduleTrial:
    """`entrants` in the order their blocks run, the first from the next step on (its caller
    switches it in); `incumbent`, one of them, the one kept without a lead beyond the noise
    (`winner`). Each runs with the stage programs `programs` gives (label -> compiled pipeline;
    absent or None: the runner's own, unchanged). Every rank of the pipeline calls `after_step`
    after each step of the trial."""

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

    def after_step(self, layout: Any) -> Entrant | None:
        """Record the step just run; returns the entrant to run from the next step on where it
        changes (None: keep the running one). `finished` tells when the trial has ended."""
        now = perf_counter()
        seconds, self._last = now - self._last, now
        self._step += 1
        if self._step < BLOCK_STEPS:
            return None
        before = self.running
        self._mine[before.label] = seconds
        self._step, self._turn = 0, self._turn + 1
        if self._turn == len(self.entrants):
            self._end_round(layout)
        after = self.winner if self.finished else self.running
        return after if after is not before else None

    @property
    def finished(self) -> bool:
        return self.rounds_run >= self.rounds or decided(self.entrants, self.rounds_run)

    @property
    def winner(self) -> Entrant:
        """The incumbent, unless another entrant was faster than it in every round run (at least
        `MIN_ROUNDS`): then, of those, the least median ratio of its step to the incumbent's."""
        leads = self._leads()
        return min(leads, key=lambda pair: pair[1])[0] if leads else self.incumbent

    def _leads(self) -> list[tuple[Entrant, float]]:
        """Each entrant faster than the incumbent in every round, with its median ratio to it."""
        base = self.incumbent.samples
        if len(base) < MIN_ROUNDS:
            return []
        leads = []
        for entrant in self.entrants:
            ratios = [mine / theirs for mine, theirs in zip(entrant.samples, base)]
            if entrant is not self.incumbent and len(ratios) == len(base) and max(ratios) < 1:
                leads.append((entrant, statistics.median(ratios)))
        return leads

    def record(self) -> dict[str, Any]:
        """What `explain()` shows: every entrant's predicted and measured steps, the choice and why."""
        winner = self.winner
        if winner is not self.incumbent:
            why = f"faster than {self.incumbent.label} in each of {self.rounds_run} round(s)"
        else:
            why = f"no other was faster than it in each of {self.rounds_run} round(s)"
        return {"entrants": [e.record() for e in self.entrants], "chosen": winner.label, "why": why}

    def _end_round(self, layout: Any) -> None:
        gathered = gather_objects(self._mine, layout.pp_group)
        times = from_first_rank([max(g[e.label] for g in gathered) for e in self.entrants], layout)
        for entrant, seconds in zip(self.entrants, times):
            entrant.samples.append(seconds)
        self._mine, self._turn = {}, 0
        self.rounds_run += 1

