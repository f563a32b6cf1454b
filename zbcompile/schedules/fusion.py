"""A backward fused again where splitting it does not pay.

Splitting a stage's backward into I and W lets W wait for a bubble, but the two actions can take
longer together than the one fused backward B (`Costs.b`, measured: a second action's own host
time, the saved values read twice). `fused_where_it_pays` takes a solved schedule and, microbatch
by microbatch, turns an I and its W into one B at the I's place where the simulator says the
schedule is no slower for it and its memory stays within the limit; the W that fill bubbles stay
split. `fused_for` fuses the backwards of given microbatches (a calibration runs B so, to
measure it).

Fusing changes when a stage's weight gradient is made, never what it is, as long as each stage
accumulates its parameter gradients in microbatch order (the same sums, bit for bit): a
microbatch's backward is fused only where every W of the stage's earlier microbatches still runs
before it (`gradients_in_order`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Sequence

from .costs import Costs, ResolvedCosts, fits_memory, resolve_costs
from .ir import Action, Schedule
from .simulate import peak_memory, simulate
from .validate import MemoryLimit, rank_limits


def _fused(schedule: Schedule, pairs: set[tuple[int, int]]) -> Schedule:
    """`schedule` with I(stage, microbatch) of every (stage, microbatch) in `pairs` turned into
    B and its W dropped."""

    def row(actions: tuple[Action, ...]) -> tuple[Action, ...]:
        out = []
        for a in actions:
            if (a.stage, a.microbatch) in pairs:
                if a.kind == "W":
                    continue
                if a.kind == "I":
                    a = Action(a.stage, "B", a.microbatch)
            out.append(a)
        return tuple(out)

    return replace(schedule, actions=tuple(row(r) for r in schedule.actions))


def gradients_in_order(row: Sequence[Action]) -> bool:
    """Whether in one rank's `row` every stage's actions that add a microbatch's parameter
    gradients (W, B) run in microbatch order."""
    last: dict[int, int] = {}
    for a in row:
        if a.kind in ("W", "B"):
            if last.get(a.stage, -1) > a.microbatch:
                return False
            last[a.stage] = a.microbatch
    return True


def fused_for(schedule: Schedule, microbatches: Collection[int]) -> Schedule:
    """`schedule` with the I and W of each of `microbatches` fused into one B at the I's place,
    on every stage (its gradients are added in another order where that leaves a stage's W and
    B out of microbatch order: a calibration's measuring steps, whose gradients are dropped)."""
    chosen = set(microbatches)
    pairs = {(a.stage, a.microbatch) for r in schedule.actions for a in r if a.kind == "I" and a.microbatch in chosen}
    return _fused(schedule, pairs)


def fused_where_it_pays(schedule: Schedule, costs: Costs | ResolvedCosts, memory_limit: MemoryLimit = None) -> Schedule:
    """`schedule` with each I and its W fused into one B (at the I's place) where the simulated
    span under `costs` does not grow, every rank's peak memory stays within `memory_limit` (one
    for every rank or one per rank; None: within the schedule's own peak) and the stage's
    gradients are still added in microbatch order, tried microbatch by microbatch on each stage
    whose fused B takes less than I + W. Unchanged where `costs` give no B time (`Costs.b`)."""
    resolved = resolve_costs(costs, schedule.stages)
    if not resolved.b:
        return schedule
    paying = [s for s in range(schedule.stages) if resolved.b[s] < resolved.i[s] + resolved.w[s]]
    split = {(a.stage, a.microbatch) for r in schedule.actions for a in r if a.kind == "I" and a.stage in paying}
    if not split:
        return schedule
    limits = rank_limits(memory_limit, schedule.ranks) or (max(peak_memory(schedule, resolved)),) * schedule.ranks
    best, span, pairs = schedule, simulate(schedule, resolved).span, set()
    for pair in sorted(split, key=lambda p: (p[1], p[0])):
        trial = _fused(schedule, pairs | {pair})
        if not all(gradients_in_order(row) for row in trial.actions):
            continue
        trial_span = simulate(trial, resolved).span
        if trial_span <= span and all(map(fits_memory, peak_memory(trial, resolved), limits)):
            best, span, pairs = trial, trial_span, pairs | {pair}
    if not pairs:
        return schedule
    return best.with_info(fused=len(pairs), fused_of=len(split))
