"""Balance by measurement: where a distributed zb-auto pipeline cuts its model, chosen again from
what its first steps measure, before the user's optimizer exists.

The compiler cuts the model where its FLOP estimates balance; real ranks disagree with FLOPs (an
embedding's backward, ops the estimate undercounts, a slower or shared GPU). So the first compile
(`pipe.compile(batch)` or the first `step()`) runs calibration steps on its batch before it
returns: a warm-up step (every other microbatch's backward fused: every program the race may
run is ready), one step with every backward fused (B's time beside I's and W's:
`schedules/fusion.py` fuses them again where that pays), one step with marked programs that time
each block inside every action (`runtime/tuning/block_timing.py`), and `profile_steps` steps whose
per-action times are kept. Nothing of them stays: the parameters' `.grad`, the buffers and the
RNG states are as they were before.

The ranks' medians are gathered (an action costs the least of its per-step medians, and a
rank's speed must agree over the timed steps, each measured apart:
`measured_cut.agreed_speeds`; a burst of other work in one step is not the rank's speed; where
the steps taken together call a rank slower but do not agree, `profile_steps` more are timed, up
to `MORE_TIMED_ROUNDS` times); the
deciding rank (`Layout.decides`: one decision for every replica and tensor-parallel rank) turns
them into per-position costs on every rank (`measured_cut.py`) and chooses the cut, in-line or
a V, by zb-auto's predicted step time (`schedules/cut_choice.py`, the decision `zbcompile plan`
makes on paper); the decision is broadcast (`layout.from_first_rank`). Where the chosen cut
beats the one in use by more than `cut_choice.RECUT_THRESHOLD`, every rank compiles the model at
the new cut, the parameters, gradients and buffers that change ranks move between them
(`state_transfer.py`), and the new compile runs with a schedule solved on the predicted costs;
otherwise the compile in use runs a schedule solved on its measured costs. Either way the
schedules race on real steps, a re-cut's against the compiler's cut (`calibration.py`), and the
cost tuner (`profile.py`) starts from the winner.

Since this happens inside the first compile, `pipe.parameters()` (which a distributed pipeline
answers only after it) already names the parameters of the final cut: an optimizer built on it
never sees a re-cut. Later compiles (other batch shapes) keep the chosen cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from zbcompile.compiler import CompiledPipeline
from zbcompile.inspect.text import layers_of
from zbcompile.passes.cut_profile import cut_layout
from zbcompile.runtime.parallel.layout import from_first_rank, gather_objects
from zbcompile.runtime.tuning import measured_cut, profile
from zbcompile.runtime.tuning.block_timing import marked, unit_times
from zbcompile.runtime.tuning.measured_cut import measured_units
from zbcompile.schedules import Costs, Schedule
from zbcompile.schedules.cut_choice import RECUT_THRESHOLD, CutDecision, CutSettings, choose_cut
from zbcompile.schedules.cut_search import Cut
from zbcompile.schedules.fusion import fused_for
from zbcompile.schedules.memory_limit import in_schedule_units

DECISION_BUDGET_S = 0.5  # zb-auto's budget per shortlisted cut (deterministic work)


@dataclass(frozen=True)
class Measured:
    """One rank's calibration: median seconds per (stage, kind) action over the timed steps and
    in each of them (`per_step`: the repetitions a rank's speed must agree over), per
    (stage, kind, unit) inside an action, half a boundary message's round trip, and the
    runtime's own time per action (`profile.host_seconds_per_action`, the median step's), and
    per stage the median fused backward B (a step with every backward fused)."""

    actions: dict[tuple[int, str], float]
    units: dict[tuple[int, str, str], float]
    comm: float
    per_step: tuple[dict[tuple[int, str], float], ...] = ()
    host: float = 0.0
    fused: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CutChoice:
    """The decision every rank runs: the cut (`placement`, `positions`), the costs zb-auto is to
    solve it with (seconds per stage or chunk), whether it changes the cut in use, what the dump
    and `pipe.explain()` say of it (`record`), the measured costs of the cut in use, and the
    `rival`: the best-predicted cut of the placement (in-line or V) that neither the cut in use
    nor the chosen one has, with its predicted costs, raced beside them (`calibration.py`)."""

    cut: Cut
    costs: Costs
    changes: bool
    record: dict[str, Any] = field(default_factory=dict)
    current_costs: Costs | None = None
    rival: tuple[Cut, Costs] | None = None

    def to_rival(self, reason: str) -> "CutChoice":
        """The rival's cut chosen after all (it measured fastest on real steps: `reason`)."""
        cut, costs = self.rival
        rival = self.record.get("rival", {"cut": str(cut)})
        record = {**self.record, "chosen": rival, "changed": True, "reason": f"{self.record.get('reason')}; {reason}"}
        return CutChoice(cut, costs, True, record, self.current_costs)


RIVAL_WITHIN = 1.25
"""A rival is raced where its predicted step is at most this times the chosen cut's: the
calibration's predictions can be off by more than the few percent between in-line and V."""


@contextlib.contextmanager
def untouched(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Steps run inside leave the module's gradients, buffers and RNG states as they were."""
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in module.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.grad = grads.get(name)
            for name, buffer in module.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


MORE_TIMED_ROUNDS = 3
"""How many times the calibration times `profile_steps` more steps while a rank's speed is in
doubt (`measured_cut.speeds_in_doubt`)."""


def calibrate(
    runner, train: Any, steps: int, layout: Any, doubt: Callable[[list[Measured]], bool], fused_b: bool = True
) -> list[Measured]:
    """Every pipeline rank's calibration (see the module docstring), in pipeline order, on every
    rank of `layout` (a collective of them all); `train()` runs one step. A warm-up step, one
    step with every backward fused (where `fused_b` asks for B's time), one step of marked
    programs (the units inside actions), `steps` timed steps, then `steps` more (at most
    `MORE_TIMED_ROUNDS` times) while the deciding rank finds `doubt` in what the pipeline
    measured so far: every rank runs as many steps."""
    schedule = runner.schedule
    microbatches = range(schedule.microbatches)
    splits = fused_b and any(a.kind == "I" for row in schedule.actions for a in row)
    with _running(runner, fused_for(schedule, microbatches[1::2]) if splits else schedule):
        train()  # warm-up: allocator, caches, every program traced or compiled
    fused = {}
    if splits:
        with _running(runner, fused_for(schedule, microbatches)):
            train()
            fused = {s: t for (s, kind), t in profile.action_medians([runner.timeline]).items() if kind == "B"}
    times = unit_times(runner.device)
    compiled = runner.compiled
    runner.use_programs(marked(compiled, times))
    try:
        train()
    finally:
        runner.use_programs(compiled)
    units = times.medians(runner.transport.timeout.total_seconds())
    comm = profile.round_trip_seconds(runner)
    timelines, host, more = [], [], 0
    while True:
        for _ in range(steps):
            train()
            timelines.append(list(runner.timeline))
            host.append(profile.host_seconds_per_action(runner.timeline, runner.comm_timeline))
        per_step = tuple(profile.action_medians([t]) for t in timelines)
        local = Measured(profile.action_medians(timelines), units, comm, per_step, statistics.median(host), fused)
        gathered = gather_objects(local, layout.pp_group)
        if not from_first_rank(more < MORE_TIMED_ROUNDS and layout.decides and doubt(gathered), layout):
            return gathered
        more += 1


@contextlib.contextmanager
def _running(runner, schedule: Schedule) -> Iterator[None]:
    """`runner` runs `schedule` inside, its own schedule again after."""
    own = runner.schedule
    runner.reschedule(schedule)
    try:
        yield
    finally:
        runner.reschedule(own)


def current_cut(compiled: CompiledPipeline, schedule: Schedule) -> Cut:
    """The cut a compile runs: in-line, or a V where its schedule holds two chunks per rank."""
    placement = "v" if schedule.stages == 2 * schedule.ranks else "in-line"
    return Cut(placement, tuple(compiled.partition.cuts))


def _merged(gathered: list[Measured]) -> tuple[dict, dict, list[dict]]:
    """The pipeline's actions (each the least of its per-step medians: a burst of other work in
    one step is not the rank's cost), units and per-step actions, over every rank's calibration."""
    actions: dict = {}
    units: dict = {}
    steps: list[dict] = [{} for _ in gathered[0].per_step]
    for part in gathered:
        actions.update(part.actions)
        units.update(part.units)
        for merged, step in zip(steps, part.per_step):
            merged.update(step)
    if steps:
        actions = {key: min(step[key] for step in steps if key in step) for key in actions}
    return actions, units, steps


def _where(compiled: CompiledPipeline, schedule: Schedule) -> tuple:
    """Where the measured actions ran: `measured_cut.measured_units`' first arguments."""
    return cut_layout(compiled.traced, compiled.partition), compiled.programs, schedule.stage_to_rank, schedule.ranks


def _repeated_speeds(where: tuple, gathered: list[Measured]) -> list[list[float]]:
    """Each timed step's rank speeds (`measured_cut.rank_speeds`) where `where` (`_where`) ran
    them, for `agreed_speeds`."""
    actions, units, steps = _merged(gathered)
    return [measured_units(*where, step, units)[1] for step in steps or [actions]]


def speeds_in_doubt(compiled: CompiledPipeline, schedule: Schedule) -> Callable[[list[Measured]], bool]:
    """`calibrate`'s doubt for this compile: a rank's speed that more steps may settle."""
    return lambda gathered: bool(measured_cut.speeds_in_doubt(_repeated_speeds(_where(compiled, schedule), gathered)))


def decide(
    compiled: CompiledPipeline, schedule: Schedule, gathered: list[Measured], options: Any, reduction: list[float]
) -> CutChoice:
    """The cut to run from every rank's calibration (`choose_cut` on `measured_cut.measured_units`);
    `reduction`: per stage, its gradient reduction in boundary messages (0 without replicas)."""
    actions, units, _ = _merged(gathered)
    comm = max(part.comm for part in gathered)
    where = _where(compiled, schedule)
    layout = where[0]
    speeds = measured_cut.agreed_speeds(_repeated_speeds(where, gathered))
    cut_units, _ = measured_units(*where, actions, units, speeds)
    largest = max(compiled.partition.boundary_bytes, default=0) or 1
    held = [sum(nbytes for fqn, nbytes, _ in layout.params if fqn in s.param_fqns) for s in compiled.partition.stages]
    per_byte = [r * comm / b for r, b in zip(reduction, held) if b > 0]
    settings = CutSettings(
        microbatches=options.microbatches,
        placements=("in-line", "v"),
        objective=options.objective,
        comm_per_byte=comm / largest,
        action_host=max(part.host for part in gathered),
        reduce_per_byte=statistics.median(per_byte) if per_byte else 0.0,
        limits=_limits(options.memory_limit, compiled.memory_unit(), schedule.ranks),
        time_budget=min(options.solver_time_budget or DECISION_BUDGET_S, DECISION_BUDGET_S),
    )
    decision = choose_cut(cut_units, current_cut(compiled, schedule), settings, RECUT_THRESHOLD)
    record = {**decision_record(decision, compiled, speeds), "timed_steps": len(gathered[0].per_step)}
    rival = _rival(decision)
    if rival is not None:
        record["rival"] = _entry(rival)
    # a B is one action: its measured time and one action's host time, as each F, I and W has
    fused = {s: t + settings.action_host for part in gathered for s, t in part.fused.items()}
    share = _fused_share(fused, decision.current.costs)

    def with_fused(costs: Costs, here: bool = False) -> Costs:
        return with_fused_backward(costs, fused if here else {}, share)

    return CutChoice(
        decision.chosen.cut, with_fused(decision.chosen.costs, not decision.changes), decision.changes, record,
        with_fused(decision.current.costs, True), (rival.cut, with_fused(rival.costs)) if rival is not None else None,
    )


def _fused_share(fused: dict[int, float], costs: Costs) -> float | None:
    """Measured B over measured I + W, over the stages of `costs` (per stage: the cut measured)
    that ran both (None: none did)."""
    resolved = costs.resolve(len(costs.f))
    split = sum(resolved.i[s] + resolved.w[s] for s in fused if s < resolved.stages)
    return sum(fused.values()) / split if fused and split > 0 else None


def with_fused_backward(costs: Costs, fused: dict[int, float], share: float | None) -> Costs:
    """`costs` (per stage) with each stage's fused backward time (`Costs.b`): measured (`fused`,
    by stage, where these are the costs of the cut measured), else its I + W times `share` (the
    calibration's measured B / (I + W)); unchanged where nothing was measured."""
    if share is None:
        return costs
    resolved = costs.resolve(len(costs.f))
    b = [fused.get(s, share * (resolved.i[s] + resolved.w[s])) for s in range(resolved.stages)]
    return dataclasses.replace(costs, b=b)


def _rival(decision: CutDecision) -> Any:
    """The best-predicted candidate of the placement neither the cut in use nor the chosen one
    has, where it predicts within `RIVAL_WITHIN` of the chosen cut (None: none)."""
    placements = {decision.current.cut.placement, decision.chosen.cut.placement}
    for prediction in decision.candidates:  # best first
        if prediction.cut.placement not in placements:
            return prediction if prediction.value <= RIVAL_WITHIN * decision.chosen.value else None
    return None


def _limits(memory_limit: Any, unit_bytes: float, ranks: int) -> tuple[float, ...] | None:
    """`memory_limit` (the pipeline's: activations per rank) in bytes per rank."""
    units = in_schedule_units(memory_limit, unit_bytes)
    if units is None:
        return None
    values = units if isinstance(units, list) else [units] * ranks
    return tuple(v * unit_bytes for v in values)


def decision_record(decision: CutDecision, compiled: CompiledPipeline, speeds: list[float]) -> dict[str, Any]:
    """What the dump and `pipe.explain()` say: the cut measured, the one chosen, why."""
    stages = [layers_of(s.param_fqns) for s in compiled.partition.stages]
    return {
        "measured": {**_entry(decision.current), "stages": stages},
        "chosen": _entry(decision.chosen),
        "changed": decision.changes,
        "predicted_gain": decision.gain,
        "threshold": decision.threshold,
        "rank_speeds": speeds,
        "reason": decision.reason,
        "candidates": [_entry(p) for p in decision.candidates[:4]],
    }


def _entry(prediction: Any) -> dict[str, Any]:
    return {"cut": str(prediction.cut), "predicted_step_s": prediction.value, "schedule": prediction.schedule}


def kept(choice: CutChoice, compiled: CompiledPipeline, schedule: Schedule, why: str) -> CutChoice:
    """The cut in use after all, where the chosen one does not compile (`why`): its measured
    costs are the decision's prediction for it."""
    record = {**choice.record, "changed": False, "reason": f"{choice.record.get('reason')}; kept: {why}"}
    return CutChoice(current_cut(compiled, schedule), choice.current_costs or choice.costs, False, record)


def solve_costs(costs: Costs, compiled: CompiledPipeline) -> Costs:
    """A cut's measured or predicted `costs` (`CutChoice.costs`, `.current_costs`) with the memory
    of `compiled` (compiled at that cut, in its unit) and no reduction time of their own (the
    schedule's solve adds it, from the message time)."""
    static = compiled.schedule_costs()
    return dataclasses.replace(costs, mem_b=static.mem_b, mem_w=static.mem_w, reduce=0.0)
