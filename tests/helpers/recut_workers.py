"""What each rank runs for tests/runtime/test_recut.py: a distributed zb-auto pipeline whose first
compile chooses its cut again by measurement (a rank slowed by the testing aid, so that it does),
or is made to re-cut (`force`: "flip", the decision replaced by a V where the compile is one
stage per rank, else one stage per rank, trusted unraced; "slower", replaced by a cut that
leaves stage 0 a quarter of the model, each race step at that cut made `SLOWER_S` longer: the
prediction said faster, the real steps say slower, and the race must undo it; "rival", the same
with the compiler's cut slowed too and the flip's V as the decision's rival, which the race must
take), against a pipeline compiled at the final cut from the start."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zbcompile
from helpers.models import build
from zbcompile.passes.partition import partition_stages
from zbcompile.runtime.tuning import contest, recut
from zbcompile.schedules import Costs
from zbcompile.schedules.cut_search import Cut

STEPS = 2
SLOWDOWN = 3.0  # rank 1's actions take this times as long: a re-cut gains far more than the threshold
# "slower": a sleep before each race step at the forced cut, inside its timed step; several
# times the step of this tiny model (about 10 ms, up to some 40 ms under the suite's load)
SLOWER_S = 0.15


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


@contextlib.contextmanager
def forced(force: str) -> Iterator[None]:
    """The cut decision replaced (`force`: see the module docstring)."""
    original, run_as = recut.decide, contest.run_as
    slowed = []  # the positions of the cuts whose race steps sleep

    def decide(compiled, schedule, gathered, options, reduction):
        measured = original(compiled, schedule, gathered, options, reduction)
        current = recut.current_cut(compiled, schedule)
        ranks = schedule.ranks
        flip = "in-line" if current.placement == "v" else "v"
        flip_stages = ranks if flip == "in-line" else 2 * ranks
        flipped = Cut(flip, tuple(partition_stages(compiled.traced, flip_stages).cuts))
        flip_costs = Costs(f=[1.0] * flip_stages, i=[1.0] * flip_stages, w=[1.0] * flip_stages)
        if force == "flip":
            cut, costs, rival = flipped, flip_costs, None
        else:  # stage 0 ends where the first of four balanced chunks does; under "rival" the flip races
            cut = Cut("in-line", tuple(partition_stages(compiled.traced, 2 * ranks).cuts)[:1])
            costs = Costs(f=[1.0] * ranks, i=[1.0] * ranks, w=[1.0] * ranks)
            rival = (flipped, flip_costs) if force == "rival" else None
            slowed.extend([list(cut.positions)] + ([list(current.positions)] if force == "rival" else []))
        record = {k: v for k, v in measured.record.items() if k != "rival"} | {"changed": cut != current}
        if rival is not None:
            record["rival"] = {"cut": str(flipped), "predicted_step_s": 1.0, "schedule": "zbv"}
        return recut.CutChoice(cut, costs, cut != current, record, measured.current_costs, rival)

    def slower_at_the_slowed_cuts(runner, entrant):
        run_as(runner, entrant)
        if list(runner.compiled.partition.cuts) in slowed:
            time.sleep(SLOWER_S)

    recut.decide = decide
    if force in ("slower", "rival"):
        contest.run_as = slower_at_the_slowed_cuts
    try:
        yield
    finally:
        recut.decide, contest.run_as = original, run_as


def _train(pipe, case) -> dict:
    """`STEPS` steps with AdamW: the first step's gradients, then the last step's gradients,
    parameters and optimizer state (this rank's shards under "shard")."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    first = None
    for _ in range(STEPS):
        optimizer.zero_grad()
        case.step(pipe)
        first = first or {n: _local(p.grad) for n, p in pipe.named_parameters()}
        optimizer.step()
    params = dict(pipe.named_parameters())
    return {
        "first_grads": first,
        "grads": {n: _local(p.grad) for n, p in params.items()},
        "params": {n: _local(p) for n, p in params.items()},
        "optimizer": {n: {k: _local(v) for k, v in optimizer.state[p].items()} for n, p in params.items()},
    }


def recut_run(stages: int, data_parallel: str, meta: bool, force: str | None) -> dict:
    """One pipeline that re-cuts (by the slowed rank, or `force`d), one compiled at its final cut
    from the start, one kept at the compiler's cut (what each rank held before the re-cut); with
    `meta` the model is built on the meta device and the full state dict loaded after compile."""
    case = build("gpt")

    def model() -> torch.nn.Module:
        if not meta:
            return copy.deepcopy(case.model)
        with torch.device("meta"):
            return type(case.model)(case.model.config)

    options = dict(
        stages=stages, microbatches=4, loss_fn=case.loss_fn, timeout=60, solver_time_budget=0,
        data_parallel=data_parallel,
    )

    def compiled(pipe):
        pipe.compile(*case.args, target=case.target)
        if meta:
            pipe.load_state_dict(case.model.state_dict(), strict=False)
        return pipe

    unraced = {"race_rounds": 0} if force == "flip" else {}
    with forced(force) if force else contextlib.nullcontext():
        pipe = compiled(zbcompile.pipeline(model(), _slowdown=None if force else {1: SLOWDOWN}, **options, **unraced))
    choice = pipe._builder.cut_choice
    reference = zbcompile.pipeline(model(), recut=False, **options)
    reference._builder.cut_choice = choice  # compiled at the final cut from the start
    compiled(reference)
    static = compiled(zbcompile.pipeline(model(), recut=False, **options))
    held = sorted(pipe._builder.ownership.held)
    return {
        "changed": choice.changes,
        "static_cut": list(static.compiled.partition.cuts),
        "cut": str(choice.cut),
        "reference_cut": list(reference.compiled.partition.cuts),
        "final_cut": list(pipe.compiled.partition.cuts),
        "held": held,
        "held_before": sorted(static._builder.ownership.held),
        "materialised": sorted(n for n, p in pipe.module.named_parameters() if not p.is_meta),
        "mine": _train(pipe, case),
        "reference": _train(reference, case),
        "explain": pipe.explain() if dist.get_rank() == 0 else None,
        "history": pipe.tuner.history,
        "record": pipe.compiled.cut_record,
        "running": pipe.schedule.name,
    }


def recut_runs(runs: list[tuple[int, str, bool, str | None]]) -> list[dict]:
    """`recut_run(*run)` for each run, in one launch."""
    return [recut_run(*run) for run in runs]
