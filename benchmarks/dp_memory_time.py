"""Data parallelism: per-rank state memory of "replicate" and "shard", and step times with the
gradient reduction overlapped against reduced after the drain.

Four gloo ranks (one thread each) run 2 replicas x a 2-rank pipeline of a GPT, each replica its
own batch, AdamW. Per `data_parallel` mode: the bytes each rank holds of parameters, gradients and
AdamW state outside a step (a DTensor's local shard only), measured after a step; then rounds
in which both modes' pipelines run the overlapped reduction (a stage's gradients posted at its last
W or B) and the reduction after the drain (`DistributedRunner.overlap_reduction = False`),
`steps_per_round` steps each between barriers, the four variants in a rotating order: seconds per
step and the paired ratios per round (after the drain / overlapped; shard / replicate), beside the
simulator's prediction of after the drain / overlapped: the schedule timed under the measured
per-action medians, each stage's reduction (its measured after-the-drain time) once after the
stage's last W on the rank's link against after the rank's last action. On this
machine the 4 processes share 2 cores, so a collective running "in the
background" competes with the computation for a core: the overlap gains less than on hardware
where the network moves the bytes.

    python benchmarks/dp_memory_time.py           # ~4 minutes on 2 cores
    python benchmarks/dp_memory_time.py --quick   # a smoke run, writes nothing
    python benchmarks/dp_memory_time.py --schedule zbv   # two stages per rank: the first one's
                                                         # reduction can run under the second's work

Writes benchmarks/results/dp_memory_time.{json,md} (dp_memory_time_<schedule>.{json,md} for another --schedule).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import _launch
import _pairing

MODES = ("replicate", "shard")


@dataclass(frozen=True)
class Settings(_launch.Settings):
    microbatches: int = 4
    rounds: int = 8  # a multiple of 4: each variant takes each place in the order equally often
    timeout_s: float = 300.0
    schedule: str = "zb-h1"


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import zbcompile
    from zbcompile.models.gpt import lm_loss
    from zbcompile.schedules import schedule_spec

    replica = dist.get_rank() // 2
    generator = torch.Generator().manual_seed(replica)  # each replica its own batch
    shape = (settings.rows * settings.microbatches, settings.seq_len)
    tokens = torch.randint(0, settings.vocab, shape, generator=generator)
    target = torch.randint(0, settings.vocab, shape, generator=generator)

    def local_bytes(tensors) -> int:
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)

    pipes, steps, memory = {}, {}, {}
    for mode in MODES:
        stages = 2 * schedule_spec(settings.schedule).chunks_per_rank
        pipes[mode] = pipe = zbcompile.pipeline(
            _launch.gpt(settings), stages=stages, microbatches=settings.microbatches, loss_fn=lm_loss,
            schedule=settings.schedule, data_parallel=mode, profile=False, timeout=settings.timeout_s,
        )
        pipe.compile(tokens, target=target)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        steps[mode] = _pairing.training_step(pipe, optimizer, tokens, target, set_to_none=False)
        steps[mode]()  # warm-up; AdamW's state exists from here on
        memory[mode] = {
            "params": local_bytes(pipe.parameters()),
            "grads": local_bytes(p.grad for p in pipe.parameters() if p.grad is not None),
            "optimizer": local_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim()),
        }
    timelines = {mode: [] for mode in MODES}  # this rank's actions per step, reduced after the drain
    reductions = {mode: [] for mode in MODES}  # this rank's reduction seconds per step, after the drain

    def timed(variant: tuple[str, str, bool]) -> float:
        mode, _, overlap = variant
        runner = pipes[mode].runner
        runner.overlap_reduction = overlap

        def step() -> None:
            steps[mode]()
            if not overlap:
                timelines[mode].append(list(runner.timeline))
                reduced = [e - s for label, s, e in runner.comm_timeline if label.startswith("REDUCE")]
                reductions[mode].append(sum(reduced))

        return _pairing.between_barriers(step, settings.steps_per_round)

    # every round times all four (mode, reduction) variants back to back, in a rotating order
    variants = [
        (mode, name, overlap) for mode in MODES for name, overlap in (("overlapped", True), ("after drain", False))
    ]
    rounds = _pairing.rounds(variants, settings.rounds, timed, rotate=True)
    times = {mode: {name: rounds[(m, name, overlap)] for m, name, overlap in variants if m == mode} for mode in MODES}
    predicted = {mode: predicted_ratio(pipes[mode].runner, timelines[mode], reductions[mode]) for mode in MODES}
    return {mode: {"memory": memory[mode], "times": times[mode], "predicted": predicted[mode]} for mode in MODES}


def predicted_ratio(runner, timelines: list, reductions: list) -> float:
    """The simulator's step time with each stage's reduction after the drain over with it after
    the stage's last W, under this pipeline's measured per-action medians and reduction times
    (gathered over the pipeline's ranks; the same on each)."""
    from zbcompile.runtime.parallel.layout import gather_objects
    from zbcompile.runtime.tuning.profile import action_medians
    from zbcompile.schedules import Costs, simulate

    schedule = runner.schedule
    local = (action_medians(timelines), statistics.median(reductions), schedule.stages_on(runner.layout.pp_rank))
    gathered = gather_objects(local, runner.layout.pp_group)
    medians = {key: value for g in gathered for key, value in g[0].items()}
    reduce = [0.0] * schedule.stages
    for _, seconds, stages in gathered:  # a rank's reduction time, shared among its stages
        for stage in stages:
            reduce[stage] = seconds / len(stages)
    per_stage = {k: [medians.get((s, k), 0.0) for s in range(schedule.stages)] for k in "FIW"}
    costs = Costs(f=per_stage["F"], i=per_stage["I"], w=per_stage["W"], reduce=reduce)
    overlapped = simulate(schedule, costs).makespan
    drained = simulate(schedule, Costs(f=per_stage["F"], i=per_stage["I"], w=per_stage["W"]))
    ends = [max(drained.end[a] for a in row if a.is_compute) for row in schedule.actions]
    after_drain = [end + sum(reduce[s] for s in schedule.stages_on(r)) for r, end in enumerate(ends)]
    return max(after_drain) / overlapped


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    modes = {}
    for mode in MODES:
        memory = [r[mode]["memory"] for r in per_rank]
        times = per_rank[0][mode]["times"]  # barriers: every rank's round times are the same span
        ratios = [a / o for a, o in zip(times["after drain"], times["overlapped"])]
        modes[mode] = {
            "bytes_per_rank": [sum(m.values()) for m in memory],
            "memory_per_rank": memory,
            "step_s": {k: statistics.median(v) for k, v in times.items()},
            "after_drain_over_overlapped": statistics.median(ratios),
            "predicted_after_drain_over_overlapped": per_rank[0][mode]["predicted"],
            "ratios": ratios,
        }
    shard_over_replicate = [
        s / r for s, r in zip(modes["shard"]["bytes_per_rank"], modes["replicate"]["bytes_per_rank"])
    ]
    times = {mode: per_rank[0][mode]["times"]["overlapped"] for mode in MODES}
    step_ratios = [s / r for s, r in zip(times["shard"], times["replicate"])]
    return {
        "modes": modes, "shard_over_replicate_bytes": shard_over_replicate,
        "shard_over_replicate_step": statistics.median(step_ratios), "shard_over_replicate_step_ratios": step_ratios,
    }


def report(data: dict) -> str:
    rows = [
        [mode, ", ".join(f"{b / 1e6:.2f} MB" for b in m["bytes_per_rank"]), f"{m['step_s']['overlapped'] * 1e3:.1f}",
         f"{m['step_s']['after drain'] * 1e3:.1f}", f"{m['after_drain_over_overlapped']:.3f}",
         f"{m['predicted_after_drain_over_overlapped']:.3f}"]
        for mode, m in data["modes"].items()
    ]
    header = ["data_parallel", "params+grads+AdamW per rank", "step ms (overlapped)", "step ms (after drain)",
              "after drain / overlapped", "predicted"]
    s, cpus = data["settings"], data["machine_before"]["cpus"]
    return "\n".join([
        "# Data parallelism: state memory and overlapped gradient reduction\n",
        f"4 gloo ranks (2 replicas x 2 pipeline ranks, {s['schedule']}, {s['microbatches']} microbatches of "
        f"{s['rows']} sequences), GPT hidden {s['hidden']}, {s['layers']} layers; machine "
        f"{_launch.load_line(data['machine_before'])}. "
        f"**The 4 processes share {cpus} cores**, so a reduction 'in the background' competes with computation for "
        "them (and with the other work on the machine, whose load is above): these are measurements under load, "
        "not what a network that moves the bytes by itself gives.\n",
        _launch.table(header, rows),
        "",
        "shard / replicate bytes per rank: " + ", ".join(f"{r:.3f}" for r in data["shard_over_replicate_bytes"]),
        f"shard / replicate step time (overlapped, paired per round): median {data['shard_over_replicate_step']:.3f} "
        f"(rounds: {', '.join(f'{r:.3f}' for r in data['shard_over_replicate_step_ratios'])})",
        "predicted: the simulator's after drain / overlapped under the measured per-action medians and reduction "
        "times. Where a rank holds one stage, its last W is the rank's last action, so the reduction cannot start "
        "earlier and the prediction is 1; with two stages per rank (a V) the first stage's reduction runs under "
        "the second's work.",
        "after drain / overlapped: median over rounds, per mode; every round times the four variants back to back "
        "in a rotating order (rounds: "
        + "; ".join(f"{mode} {', '.join(f'{r:.3f}' for r in m['ratios'])}" for mode, m in data["modes"].items())
        + ")",
    ])


def main() -> None:
    parser = _launch.parser(__doc__.splitlines()[0], "a smoke run (writes nothing)", no_write=False)
    parser.add_argument("--schedule", default=Settings.schedule, help="the pipeline schedule (default %(default)s)")
    args = parser.parse_args()
    settings = Settings(schedule=args.schedule)
    if args.quick:
        settings = replace(settings, rounds=1, steps_per_round=1, layers=4, hidden=32, seq_len=16)
    name = "dp_memory_time" if args.schedule == Settings.schedule else f"dp_memory_time_{args.schedule}"
    _launch.run_and_report(name, 4, rank_main, settings, analyse, report, write=_launch.writes(args))


if __name__ == "__main__":
    main()
