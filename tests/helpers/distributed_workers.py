"""What each rank runs in the multi-process tests (importable by spawned processes)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zbcompile
from helpers.models import NAMES, BatchNormConvNet, batch_for, build, image_batch, share
from helpers.multiprocess import replica_of
from zbcompile.schedules import Schedule, pipeline_ranks, schedule_spec

SINGLE_CHUNK = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto")
TWO_CHUNK = ("interleaved-1f1b", "zbv")  # two stages per rank
# more two-chunk schedules: on every model with 2 ranks, on the smallest model with 4 (4 processes
# on 2 cores are slow)
MORE_TWO_CHUNK = ("looped-bfs", "v-min", "v-half", "v-zb", "dualpipev")
# two copies of the pipeline, each rank holds a stage of each: like MORE_TWO_CHUNK
MIRRORED = ("dualpipe",)
SMALLEST = "mlp"
# torch's DualPipeV on 4 ranks, 10 microbatches, from torch's own tests (tests/data/README.md)
TORCH_DUALPIPEV = Schedule.from_csv(
    (Path(__file__).parents[1] / "data" / "dualpipev_4rank_10mb.csv").read_text(), name="torch-dualpipev-4rank-10mb"
)


def battery_runs(ranks: int) -> list[tuple[str, str, int, int]]:
    """Every model under every schedule (two stages per rank for the two-chunk schedules), in one
    launch per rank count, ordered by placement: consecutive runs that keep the stages on the same
    ranks share one compile."""
    runs = []
    for name in NAMES:
        more = MORE_TWO_CHUNK + MIRRORED if ranks == 2 or name == SMALLEST else ()
        schedules = sorted(
            SINGLE_CHUNK + TWO_CHUNK + more,
            key=lambda s: (schedule_spec(s).placement(2 * ranks), schedule_spec(s).mirrored),
        )
        runs += [(name, s, ranks * schedule_spec(s).chunks_per_rank, 4) for s in schedules]
    if ranks == TORCH_DUALPIPEV.ranks:  # a schedule given in torch's CSV format
        runs.append((SMALLEST, TORCH_DUALPIPEV, TORCH_DUALPIPEV.stages, TORCH_DUALPIPEV.microbatches))
    return runs


# 2 data-parallel replicas x 2 stages on 4 ranks: zb-h1, dualpipe (each replica's two copies summed), and
# a (loss_sum, count) loss over padded targets
REPLICA_RUNS = [("gpt", "zb-h1", 2, 2), (SMALLEST, "dualpipe", 2, 2), ("padded-gpt", "zb-h1", 2, 2)]


def _placement(schedule: str | Schedule, stages: int) -> tuple:
    """Where `schedule` (a name or a given Schedule) runs each stage, and whether it is mirrored."""
    if isinstance(schedule, Schedule):
        return schedule.stage_to_rank, schedule.mirrored_from is not None
    spec = schedule_spec(schedule)
    return spec.placement(stages), spec.mirrored


def one_step(runs: list[tuple[str, str | Schedule, int, int]]) -> dict:
    """For each (model, schedule, stages, microbatches): one step on `batch_for(microbatches)`
    rows; returns per run the loss (None off the last stage), this rank's reported gradients and
    state-dict keys, and the parameter bytes it holds. Consecutive runs of one model whose
    schedules place the stages alike share one compiled pipeline (`set_schedule`)."""
    results = {}
    pipe, previous = None, None
    for name, schedule, stages, microbatches in runs:
        placement = (name, stages, microbatches, *_placement(schedule, stages))
        if placement != previous:
            case = build(name, batch=batch_for(microbatches)).share(
                *replica_of(pipeline_ranks(schedule, stages))
            )  # each replica its share
            pipe = zbcompile.pipeline(
                case.model, stages=stages, microbatches=microbatches, loss_fn=case.loss_fn,
                schedule=schedule, timeout=60, solver_time_budget=0.5,
            )
            previous = placement
        else:
            pipe.set_schedule(schedule)
        pipe.zero_grad()
        loss = case.step(pipe)
        results[(name, schedule, stages, microbatches)] = {
            "loss": loss,
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
            "state": {k: v.clone() for k, v in pipe.state_dict().items()},
            "held": {k: v.clone() for k, v in pipe.held_state_dict().items()},
            "param_bytes": sum(p.numel() * p.element_size() for p in case.model.parameters() if not p.is_meta),
            "peak_live_bytes": pipe.runner.peak_live_bytes,
            "timeline": list(pipe.runner.timeline),
        }
    return results


def train(name: str, schedules: tuple[str, ...], stages: int, optimizers: tuple[str, ...], steps: int) -> dict:
    """For each schedule and optimizer, `steps` steps from the same start; returns this rank's
    state dict and the parameters it holds after each run."""
    results = {}
    for schedule in schedules:
        for optimizer in optimizers:
            case = build(name)
            pipe = zbcompile.pipeline(
                case.model, stages=stages, microbatches=4, loss_fn=case.loss_fn, schedule=schedule, timeout=60,
                solver_time_budget=0.5,
            )
            pipe.compile(*case.args, target=case.target, **case.kwargs)
            opt = make_optimizer(optimizer, pipe.parameters())
            for _ in range(steps):
                opt.zero_grad()
                case.step(pipe)
                opt.step()
            results[(schedule, optimizer)] = {
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            }
    return results


def buffer_update_steps(runs: list[tuple[int, str]], microbatches: int, steps: int) -> dict:
    """BatchNormConvNet in train mode, for each (stages, schedule): `steps` SGD steps (lr 0.1)
    from the same start; per step this rank's loss, gradients and state dict after the update."""
    results = {}
    for stages, schedule in runs:
        torch.manual_seed(0)
        model = BatchNormConvNet()
        replicas = replica_of(schedule_spec(schedule).ranks(stages))
        x, target = (share(t, *replicas) for t in image_batch())
        pipe = zbcompile.pipeline(
            model, stages=stages, microbatches=microbatches, loss_fn=F.cross_entropy, schedule=schedule, timeout=60,
            solver_time_budget=0.5,
        )
        pipe.compile(x, target=target)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        record = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = pipe.step(x, target=target)
            optimizer.step()
            record.append({
                "loss": loss,
                "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
            })
        results[schedule] = record
    return results


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps well above fp32 rounding of the gradients: Adam divides by sqrt(v), so a parameter whose
    # true gradient is zero (an attention key bias) would turn rounding noise into full steps
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-4)


def eager_adamw(case, steps: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """`steps` eager AdamW steps (`make_optimizer`'s) of `case`'s model over its whole batch:
    each step's loss, and the optimizer (its state after the last step)."""
    optimizer = make_optimizer("adamw", case.model.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = case.eager_loss()
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
    return losses, optimizer


def meta_init(stages: int) -> dict:
    """A GPT built on the meta device: each rank materialises only its own parameters."""
    case = build("gpt")
    with torch.device("meta"):
        model = type(case.model)(case.model.config)
    pipe = zbcompile.pipeline(model, stages=stages, microbatches=2, loss_fn=case.loss_fn, schedule="1f1b", timeout=60)
    pipe.compile(*case.args, target=case.target)
    pipe.load_state_dict(case.model.state_dict(), strict=False)
    loss = case.step(pipe)
    return {
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        "materialised": sorted(n for n, p in model.named_parameters() if not p.is_meta),
    }


def dies_mid_step(victim: int) -> str:
    """Rank `victim` exits in the middle of the first step; the others report their error."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="1f1b", timeout=10)
    pipe.compile(*case.args, target=case.target)
    dist.barrier()  # both ranks are set up (process groups connected): the failure is mid-step
    if dist.get_rank() == victim:
        executor = pipe.executors[0]
        original = executor.forward

        def forward_then_die(microbatch, inputs):
            if microbatch == 1:
                import os

                os._exit(3)
            return original(microbatch, inputs)

        executor.forward = forward_then_die
    try:
        case.step(pipe)
    except Exception as error:  # noqa: BLE001 - the test inspects the message
        return f"{type(error).__name__}: {error}"
    return "no error"


def profiled_runs(runs: list[tuple[int, dict]]) -> list[dict]:
    """`profiled(max_steps, **options)` for each (max_steps, options) in one launch."""
    return [profiled(max_steps, **options) for max_steps, options in runs]


SOLVE_WAIT_S = 45  # how long rank 0 waits for a background solve: below the group's and pipeline's 60 s


def profiled(max_steps: int, **options) -> dict:
    """Default options (zb-auto measures its costs) but `options`, until the schedule solved
    with measured costs is in use (every rank switches after the same step, the one after the
    solve started: each rank waits for the solve before stepping on) or `max_steps`, then one
    more step; returns the costs, the steps run, this rank's gradients, the schedule and
    the recompute levels."""
    case = build("gpt")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, timeout=60, solver_time_budget=0, **options
    )
    steps = 0
    while pipe.measured_costs is None and steps < max_steps:
        case.step(pipe)
        steps += 1
        if pipe.tuner is not None and pipe.tuner.solving:  # the switch follows the next step, whatever its speed
            pipe.tuner.switch.wait(SOLVE_WAIT_S)
            dist.barrier()  # the other ranks wait here, not in a step's receive
    case.step(pipe)
    costs = pipe.measured_costs
    return {
        "costs": None if costs is None else (list(costs.f), list(costs.i), list(costs.w), costs.comm),
        "steps": steps + 1,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        "schedule": [list(map(str, row)) for row in pipe.schedule.actions],
        "placement": pipe.schedule.info.get("placement"),
        "cost_source": pipe.schedule.info.get("cost_source"),
        "history": None if pipe.tuner is None else pipe.tuner.history,
        "name": pipe.schedule.name,
        "raced": ((pipe.compiled.cut_record or {}).get("race") or {}).get("chosen"),
        "levels": pipe.compiled.recompute_levels,
        "stage_programs": [id(e.program) == id(pipe.compiled.programs[s]) for s, e in pipe.runner.executors.items()],
    }


def bad_world_size() -> str:
    """A 2-stage pipeline on a world that is not a multiple of 2."""
    case = build("mlp")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="1f1b", timeout=30)
    try:
        case.step(pipe)
    except ValueError as error:
        return str(error)
    return "no error"


def new_shapes_recompile() -> dict:
    """A step with a smaller batch recompiles; both steps give eager's gradients."""
    case = build("gpt")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, schedule="zb-h1", timeout=30)
    case.step(pipe)
    half = [a[:4] for a in case.args]
    pipe.step(*half, target=case.target[:4])
    return {n: p.grad.clone() for n, p in pipe.named_parameters()}


# the sequence lengths of `variable_lengths`'s steps: the second compiles shape-generically, the rest run on it
VARIABLE_LENGTHS = (8, 12, 8, 16, 5, 20, 11)


def variable_lengths(lengths: tuple[int, ...] = VARIABLE_LENGTHS) -> dict:
    """The Llama-style case at every length of `lengths`, one step each (gradients zeroed between),
    with default options; once the shape-generic compile is made (the second length: a step that
    compiles needs the batch on every rank), each rank passes only what its stages read (the
    inputs where it holds the first stage, the target where it holds the last: zb-auto may choose
    a V). Returns per step this rank's loss and gradients, and whether the step ran on the
    shape-generic compile."""
    rank = dist.get_rank()
    case = build("llama")
    pipe = zbcompile.pipeline(case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, timeout=120)
    steps = []
    for step, length in enumerate(lengths):
        tokens, target = variable_length_batch(length)
        holds = [s for s, r in enumerate(pipe.schedule.stage_to_rank) if r == rank] if step >= 2 else None
        first, last = holds is None or 0 in holds, holds is None or len(pipe.schedule.stage_to_rank) - 1 in holds
        loss = pipe.step(tokens if first else None, target=target if last else None)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        steps.append({"loss": loss, "grads": grads, "generic": pipe.compiled.traced.symbols is not None})
        pipe.zero_grad()
    return {"steps": steps}


def variable_length_batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The llama case's batch at `length` tokens per row (tokens and next-token targets)."""
    generator = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, 64, (batch_for(2), length), generator=generator)
    return tokens, tokens.roll(-1, 1)


def partial_batches(runs: list[tuple[str, str, int]], steps: int = 2) -> dict:
    """For each (model, schedule, stages): `steps` steps in which each rank passes only what its
    stages read (the inputs on the first stage's rank, the target on the last stage's rank,
    None elsewhere); returns this rank's losses and gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, schedule, stages in runs:
        case = build(name)
        pipe = zbcompile.pipeline(
            case.model, stages=stages, microbatches=4, loss_fn=case.loss_fn, schedule=schedule, timeout=60,
            solver_time_budget=0.5,
        )
        first, last = 0, (0 if schedule == "zbv" else world - 1)  # zbv folds the stages into a V
        losses = []
        for _ in range(steps):
            args = case.args if rank == first else (None,) * len(case.args)
            kwargs = case.kwargs if rank == first else {}
            losses.append(pipe.step(*args, target=case.target if rank == last else None, **kwargs))
        results[(name, schedule, stages)] = {
            "losses": losses,
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
        }
    return results


def misplaced_batches() -> dict:
    """Mistakes, each rank's error message: ranks of one pipeline passing batches of different
    sizes (both parts, then the inputs on the first stage's rank and the target on the last's),
    two data-parallel replicas (of a one-stage pipeline) passing batches of different sizes, and
    the first stage's rank passing None for the inputs (its peer waits for them until its 5 s
    timeout)."""
    rank = dist.get_rank()
    case = build("mlp")
    errors = {}

    def attempt(label: str, pipe, *args, target=None) -> None:
        try:
            pipe.step(*args, target=target)
            errors[label] = "no error"
        except Exception as error:  # noqa: BLE001 - the test inspects the message
            errors[label] = f"{type(error).__name__}: {error}"

    def fresh(timeout: float, stages: int = 2):
        return zbcompile.pipeline(
            case.model, stages=stages, microbatches=2, loss_fn=case.loss_fn, schedule="1f1b", timeout=timeout
        )

    rows = 4 if rank == 0 else 8
    attempt("different sizes", fresh(30), case.args[0][:rows], target=case.target[:rows])
    # the first stage's rank passes only the inputs, the last stage's only a target of another size
    attempt(
        "first and last differ",
        fresh(30),
        case.args[0][:4] if rank == 0 else None,
        target=None if rank == 0 else case.target,
    )
    attempt(
        "replicas differ", fresh(30, stages=1), case.args[0][:rows], target=case.target[:rows]
    )  # 2 replicas of one stage
    inputs = (None,) if rank == 0 else case.args
    attempt("first stage without inputs", fresh(5), *inputs, target=case.target)
    return errors


def pipelines_in_process_groups() -> dict:
    """Four ranks. First two independent 2-stage pipelines, each over its own process group
    (created by its members only): ranks 0-1 train the MLP, ranks 2-3 the GPT (tied embedding).
    Then all four as 2 replicas x 2 stages of the GPT, given a ("dp", "pp") DeviceMesh; then two
    independent GPT pipelines, each given its "pp" slice of a ("tp", "pp") mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    group = dist.new_group([0, 1] if rank < 2 else [2, 3], use_local_synchronization=True)
    results = {}
    for label, name, process_group, microbatches in (
        ("group", "mlp" if rank < 2 else "gpt", group, 4),
        ("mesh", "gpt", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")), 2),
        ("slice", "gpt", init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))["pp"], 2),
    ):
        case = build(name).share(2, rank // 2) if label == "mesh" else build(name)  # mesh: each replica its share
        pipe = zbcompile.pipeline(
            case.model, stages=2, microbatches=microbatches, loss_fn=case.loss_fn, schedule="zb-h1", timeout=60,
            process_group=process_group,
        )
        loss = case.step(pipe)
        results[label] = {"name": name, "loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}}
    case = build("mlp")  # a process group of two pipelines' ranks: replicas need a DeviceMesh
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=2, loss_fn=case.loss_fn, process_group=dist.group.WORLD
    )
    try:
        case.step(pipe)
        results["error"] = "no error"
    except ValueError as error:
        results["error"] = str(error)
    return results


def late_messages(delay: float, steps: int) -> dict:
    """The GPT under zb-h2, zb-auto and 1f1b (one compile, `set_schedule`), with readiness
    followed and not, `steps` steps each. Rank 0 sleeps `delay` seconds before each forward
    message it sends (late for real: W may move into rank 1's waits by its forecast, as many as
    the machine's speed lets fit), and rank 1's transport tells no forward message arrived
    before a computation waits for it (late by the rules: a W the plan ran before that
    computation always moves into the wait). Returns per run this rank's accumulated gradients,
    its program, the W it runs after a computation the plan put them before (`overtaken`) and,
    per step, the timeline and the W it moved."""
    results = {}
    for follow in (True, False):
        case = build("gpt")
        pipe = zbcompile.pipeline(
            case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule="zb-h2", timeout=60,
            follow_readiness=follow, profile=False, solver_time_budget=0,
        )
        pipe.compile(*case.args, target=case.target)
        transport = pipe.runner.transport
        if dist.get_rank() == 0:
            send = transport.send

            def late_send(tensors, peer, tag, action, send=send):
                if "SEND_F" in action:
                    time.sleep(delay)
                send(tensors, peer, tag, action)

            transport.send = late_send
        else:
            arrived = transport.arrived
            transport.arrived = lambda pending, arrived=arrived: "RECV_F" not in pending.action and arrived(pending)
        for schedule in ("zb-h2", "zb-auto", "1f1b"):
            pipe.set_schedule(schedule)
            pipe.zero_grad()
            steps_seen = []
            for _ in range(steps):
                case.step(pipe)
                steps_seen.append({"moved": pipe.runner.moved_w, "timeline": list(pipe.runner.timeline)})
            results[(schedule, follow)] = {
                "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
                "program": [str(a) for a in pipe.runner.actions],
                "overtaken": sorted({str(w) for ws in pipe.runner.program.overtaken.values() for w in ws}),
                "steps": steps_seen,
            }
    return results
