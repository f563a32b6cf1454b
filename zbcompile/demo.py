"""`zbcompile demo`: zero bubble against 1F1B on this machine.

1. Lay the pipeline out on the machine (`choose_layout`): one rank per available core (at least
   2, at most `MAX_RANKS`; on a machine with 2 or more GPUs one rank per GPU), one stage per rank,
   2 microbatches per stage, where zero bubble's advantage over 1F1B is largest.
2. Size a small GPT from one measured transformer block (`size_model`) so that a step takes
   0.1-0.5 s, and say in one line what was chosen and why.
3. Train it on the text shipped with the package as two pipelines with default options, one
   scheduled by 1F1B and one by zb-auto, on local processes (gloo on CPU, NCCL on GPUs). Warm-up
   lasts until zb-auto runs the schedule re-solved from the costs measured over its first steps
   (the default); then rounds alternate between the two (the order reverses every round), each
   timing a few steps run back to back, as a training loop runs them.
4. Print the median step times, the speed-up paired per round, the simulator's predicted gain
   for this layout and the share of it the run captured, and whether other processes took CPU
   meanwhile (`zbcompile.measure`). Leave dumps, `report.html` (both schedules' measured steps one
   above the other, bubbles shaded) and `timelines.png` in the output directory.

`examples/train_gpt.py` shows the same training under torchrun."""

from __future__ import annotations

import argparse
import importlib.resources
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zbcompile
from zbcompile import measure
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import Block, lm_loss
from zbcompile.runtime.parallel.local_ranks import free_port
from zbcompile.runtime.tuning import profile
from zbcompile.schedules import DEFAULT_SCHEDULE, REFERENCE_SCHEDULE, Costs

SCHEDULES = (REFERENCE_SCHEDULE, DEFAULT_SCHEDULE)  # the reference first
MAX_RANKS = 8
MAX_WARM_UP = 200  # steps a pipeline may take to run the schedule chosen with measured costs (all ranks alike)
MICROBATCHES_PER_STAGE = 2  # zb-auto's simulated steady-state gain over 1F1B peaks at m = 2p (p = 2..8)
VOCAB, SEQ_LEN, HEADS, ROWS = 256, 64, 4, 4  # bytes as tokens; ROWS sequences per microbatch
WIDTHS = (64, 128, 256, 512, 1024)  # candidate hidden sizes, smallest first
TARGET_STEP_S, STEP_RANGE_S = 0.35, (0.1, 0.5)  # per-action overheads weigh less in a longer step
MAX_LAYERS_PER_STAGE = 6
ROUNDS, STEPS_PER_ROUND, SETTLE_STEPS = 10, 6, 1
BUSY_CORES = 0.1  # other processes' CPU use (cores) above which the numbers are called noisy


def text_batches(batch: int, seq_len: int, seed: int = 0):
    """Endless random windows of the bundled text as (tokens, next tokens), bytes as tokens."""
    data = importlib.resources.files("zbcompile").joinpath("data/tiny.txt").read_bytes()
    tokens = torch.tensor(list(data), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# --- the layout --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoLayout:
    """Where the demo's pipeline runs: `ranks` processes, one stage each."""

    cores: int
    gpus: int
    ranks: int
    threads: int  # intra-op threads per rank (CPU)
    microbatches: int
    backend: str  # "gloo" (CPU) or "nccl" (one GPU per rank)

    @property
    def stages(self) -> int:
        return self.ranks

    @property
    def on_gpus(self) -> bool:
        return self.backend == "nccl"

    @property
    def shares_cores(self) -> bool:
        """More ranks than cores: a rank's bubble is another rank's compute time."""
        return not self.on_gpus and self.ranks > self.cores

    @property
    def spare_cores(self) -> int:
        """Cores the ranks leave free for other processes (a rank driving a GPU keeps one busy)."""
        return max(0, self.cores - self.ranks * self.threads)

    def describe(self) -> str:
        stages = (f"one stage per rank, {self.microbatches} microbatches ({MICROBATCHES_PER_STAGE} per stage: zero "
                  "bubble's predicted gain over 1F1B peaks there)")
        if self.on_gpus:
            why = f"at most {MAX_RANKS}" if self.gpus > MAX_RANKS else "one per GPU"
            return f"{self.gpus} GPUs -> {self.ranks} nccl ranks ({why}), {stages}"
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        gpu_note = f" ({self.gpus} GPU: a pipeline needs 2, so on CPU)" if self.gpus == 1 else ""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''} each"
        why = f"at most {MAX_RANKS}, {threads}" if self.cores > MAX_RANKS else f"one per core, {threads}"
        if self.shares_cores:
            them = "it" if self.cores == 1 else "them"
            why = f"sharing {them}: a pipeline needs 2; the comparison will be unreliable"
        return f"{cores}{gpu_note} -> {self.ranks} gloo ranks ({why}), {stages}"


def available_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_layout(cores: int | None = None, gpus: int | None = None) -> DemoLayout:
    """One rank per GPU when there are 2 or more, else one rank per core (at least 2: the
    smallest pipeline); at most `MAX_RANKS`; one stage per rank; `MICROBATCHES_PER_STAGE`
    microbatches per stage. `cores` and `gpus` default to this machine's."""
    cores = available_cores() if cores is None else cores
    gpus = available_gpus() if gpus is None else gpus
    if cores < 1 or gpus < 0:
        raise ValueError(f"choose_layout: need cores >= 1 and gpus >= 0, got cores={cores}, gpus={gpus}")
    if gpus >= 2:
        ranks, threads, backend = min(gpus, MAX_RANKS), 1, "nccl"
    else:
        ranks = min(max(2, cores), MAX_RANKS)
        threads, backend = max(1, cores // ranks), "gloo"
    return DemoLayout(cores, gpus, ranks, threads, MICROBATCHES_PER_STAGE * ranks, backend)


# --- the model's size --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    block_s: float  # forward + backward of one block on one microbatch, measured
    step_s: float  # the 1F1B step this predicts

    def config(self) -> GPTConfig:
        # untied: a tied embedding and LM head would exchange gradients between the first and the
        # last rank at the end of every step, lining the ranks up as a barrier does, so steps
        # could not overlap and zb-auto (solved for steps run back to back) would lose its edge
        return GPTConfig(
            vocab_size=VOCAB, seq_len=SEQ_LEN, hidden=self.hidden, heads=HEADS, layers=self.layers, tie_embeddings=False
        )

    def describe(self) -> str:
        low, high = STEP_RANGE_S
        return (f"GPT (untied embeddings) with {self.layers} layers, hidden {self.hidden}, {ROWS} sequences of "
                f"{SEQ_LEN} bytes per microbatch: a 1F1B step ~{self.step_s:.2f} s ({low}-{high} s wanted; one block "
                f"measured at {self.block_s * 1e3:.1f} ms)")


def size_model(layout: DemoLayout, block_seconds: Callable[[int], float]) -> ModelSize:
    """The widest of `WIDTHS` whose one-layer-per-stage step stays within `TARGET_STEP_S`, with as
    many layers per stage as bring the step nearest to it (at most `MAX_LAYERS_PER_STAGE`).
    `block_seconds(hidden)`: seconds of one block's forward + backward on one microbatch. A
    1F1B step runs m + p - 1 such slots one after another on its busiest path; ranks sharing a
    core run at that share of its speed."""
    slots = layout.microbatches + layout.stages - 1
    slowdown = max(1.0, layout.ranks * layout.threads / layout.cores) if not layout.on_gpus else 1.0
    chosen = None
    for hidden in WIDTHS:
        block = block_seconds(hidden)
        if chosen is not None and slots * block * slowdown > TARGET_STEP_S:
            break
        chosen = (hidden, block)
    hidden, block = chosen
    one_layer = slots * block * slowdown
    per_stage = min(MAX_LAYERS_PER_STAGE, max(1, round(TARGET_STEP_S / one_layer)))
    return ModelSize(hidden, per_stage * layout.stages, block, per_stage * one_layer)


def measured_block_seconds(hidden: int, layout: DemoLayout, repeats: int = 3) -> float:
    """Median seconds of forward + backward of one GPT block on one microbatch, with the
    threads (CPU) or the device (GPU) one rank will have."""
    device = torch.device("cuda", 0) if layout.on_gpus else torch.device("cpu")
    torch.set_num_threads(layout.threads)
    block = Block(GPTConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, hidden=hidden, heads=HEADS)).to(device)
    x = torch.randn(ROWS, SEQ_LEN, hidden, device=device, requires_grad=True)
    times = []
    for _ in range(repeats + 1):  # the first warms up
        started = time.perf_counter()
        block(x).sum().backward()
        if layout.on_gpus:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return measure.median(times[1:])


# --- what the run found ------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """Step times per schedule (medians over rounds), zb-auto's speed-up over 1F1B paired per
    round, the simulator's predicted gain and how much CPU other processes took meanwhile."""

    step_s: dict[str, float]
    rounds: int
    speedup: float
    predicted: float  # with each schedule's own measured action times
    predicted_solved: float  # under the costs zb-auto was solved with
    cost_source: str  # where those came from
    others_cores: float
    spare_cores: float

    @property
    def captured(self) -> float:
        """The measured gain's share of the predicted one ((speed-up - 1) / (predicted - 1))."""
        return (self.speedup - 1) / (self.predicted - 1) if self.predicted > 1 else float("nan")

    @property
    def busy(self) -> bool:
        """Other processes took more than `BUSY_CORES` of the cores the ranks ran on."""
        return self.others_cores - self.spare_cores > BUSY_CORES

    def lines(self, layout: DemoLayout, losses: dict[str, float | None]) -> list[str]:
        reference, other = SCHEDULES
        rows = [f"{'schedule':>9s}  {'median step':>11s}  {'final loss':>10s}"]
        for name in SCHEDULES:
            loss = losses.get(name)
            rows.append(f"{name:>9s}  {self.step_s[name] * 1e3:8.1f} ms  {'-' if loss is None else f'{loss:.4f}':>10s}")
        if losses.get(reference) == losses.get(other):
            rows[-1] += " (the same: every schedule computes the same gradients)"
        faster = "faster" if self.speedup >= 1 else "SLOWER"
        rows.append(
            f"{other} vs {reference}: {self.speedup:.3f}x the speed ({faster}; median over {self.rounds} rounds of "
            f"{reference} step time / {other} step time in the same round)"
        )
        captured = f"{self.captured:.0%}" if self.predicted > 1 else "n/a"
        rows.append(
            f"simulator's predicted gain for {layout.stages} stages x {layout.microbatches} microbatches: "
            f"{self.predicted:.3f}x (steady state, each schedule timed by its own measured actions, the optimizer step "
            f"and batch as measured; {self.predicted_solved:.3f}x under the {self.cost_source} costs zb-auto was "
            f"solved with); captured: {captured}"
        )
        rows.append(self.machine_line(layout))
        return rows

    def machine_line(self, layout: DemoLayout) -> str:
        used = f"other processes used {self.others_cores:.0%} of a core during the run"
        if math.isnan(self.others_cores):
            used = "other processes' CPU use during the run is unknown here (no /proc/stat)"
        if layout.shares_cores:
            return (f"UNRELIABLE: {layout.ranks} ranks shared {layout.cores} core(s), so a rank's bubble was another "
                    "rank's compute time and this measured the operating system's scheduler more than the pipeline; "
                    f"{used}")
        if self.busy:
            return f"machine was BUSY: {used}, so these numbers are noisy; run again on a quieter machine"
        if math.isnan(self.others_cores):
            return used
        return f"machine quiet: {used}"


def summarize(
    periods: dict[str, Sequence[float]], predicted: tuple[float, float, str], others_cores: float, spare_cores: float
) -> Summary:
    """`periods[schedule]`: seconds per step per round, rounds alike; `predicted`: `predicted_gains`'."""
    reference, other = SCHEDULES
    step_s = {name: measure.median(values) for name, values in periods.items()}
    speedup = measure.paired_ratio(periods[reference], periods[other])
    return Summary(step_s, len(periods[reference]), speedup, *predicted, others_cores, spare_cores)


def predicted_gains(
    runs: dict[str, "_Training"], action_medians: dict[str, list[dict]], loop_s: dict[str, float]
) -> tuple[float, float, str]:
    """The simulator's steady-state gain of zb-auto over 1F1B for the step as the rounds time it
    (1F1B's period / zb-auto's; a period is the simulated span plus `loop_s[schedule]`, the
    training loop's own time per step: batch, zero_grad, optimizer step): under each schedule's
    own measured action medians (`action_medians[schedule]`; 1F1B's fused backward is often
    cheaper than I and W apart), and under the costs zb-auto was solved with (1F1B's backward as
    I + W), with where those came from ("measured" or "static")."""
    from zbcompile.inspect.write import schedule_costs_used
    from zbcompile.runtime.tuning.profile import costs_of
    from zbcompile.schedules import simulate
    from zbcompile.schedules.costs import resolve_costs

    reference, other = pipes = [runs[name].pipe for name in SCHEDULES]
    solved, source = schedule_costs_used(other.schedule, other.compiled, other.measured_costs)
    comm = solved.comm if source == "measured" else 0.0  # the static estimates have none
    measured = [  # each on its own stages: zb-auto's may be a V's chunks after its re-cut
        costs_of(action_medians[n], comm, p.schedule.stages, p.compiled.schedule_costs())
        for n, p in zip(SCHEDULES, pipes)
    ]
    chunks = other.schedule.stages // reference.schedule.stages  # 1F1B under zb-auto's: a V's chunks summed
    solved_in_line = resolve_costs(solved, other.schedule.stages).merged(chunks) if chunks > 1 else solved

    def gain(*costs: Costs) -> float:  # 1F1B's period over zb-auto's, each under its costs
        periods = [simulate(p.schedule, c).span + loop_s[n] for n, p, c in zip(SCHEDULES, pipes, costs)]
        return periods[0] / periods[1]

    return gain(measured[0], measured[1]), gain(solved_in_line, solved), source


# --- the ranks ---------------------------------------------------------------------------------


class _Training:
    """One schedule's pipeline on this rank, its optimizer and its data; every schedule starts
    from the same weights and sees the same batches."""

    def __init__(self, schedule: str, layout: DemoLayout, size: ModelSize, device: torch.device, dump_dir: str) -> None:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(size.config())
        self.pipe = zbcompile.pipeline(
            model, stages=layout.stages, microbatches=layout.microbatches, loss_fn=lm_loss, schedule=schedule,
            dump_dir=dump_dir,
        )
        self.device = device
        self.batches = text_batches(layout.microbatches * ROWS, SEQ_LEN)
        tokens, targets = next(self.batches)
        self.pipe.compile(tokens.to(device), target=targets.to(device))
        self.optimizer = torch.optim.AdamW(self.pipe.parameters(), lr=3e-3)
        self.loss: torch.Tensor | None = None
        self.timelines: list | None = None  # this rank's step timelines, once recording
        self.loop_s: list[float] = []  # per recorded step: the loop's time outside `pipe.step`

    def warm_up(self) -> int:
        """Two steps, then, where costs are measured, until a schedule chosen with them runs with
        no solve in flight (at most `MAX_WARM_UP`), and one more; all ranks alike. Returns the
        steps run."""
        self.step()
        self.step()
        steps = 2
        tuner = self.pipe.tuner
        if tuner is not None:
            while not tuner.settled and steps < MAX_WARM_UP:
                self.step()
                steps += 1
            self.step()
            steps += 1
        return steps

    def step(self) -> None:
        started = time.perf_counter()
        tokens, targets = next(self.batches)
        self.optimizer.zero_grad()
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        pipeline_started = time.perf_counter()
        loss = self.pipe.step(tokens, target=targets)
        pipeline_s = time.perf_counter() - pipeline_started
        self.optimizer.step()
        if loss is not None:
            self.loss = loss
        if self.timelines is not None:
            if self.device.type == "cuda":  # the optimizer's kernels, not only their launch
                torch.cuda.current_stream(self.device).synchronize()
            self.timelines.append(list(self.pipe.runner.timeline))
            self.loop_s.append(time.perf_counter() - started - pipeline_s)


def _rank_main(rank: int, layout: DemoLayout, size: ModelSize, port: int, out_dir: str, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if layout.on_gpus:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(layout.threads)
        device = torch.device("cpu")
    dist.init_process_group(layout.backend, rank=rank, world_size=layout.ranks, timeout=timedelta(seconds=300))
    reporter = rank == layout.ranks - 1  # prints the summary (each loss gathered from its last stage's rank)
    try:
        if reporter:
            print("compiling both pipelines", flush=True)
        runs = {name: _Training(name, layout, size, device, os.path.join(out_dir, "dump", name)) for name in SCHEDULES}
        warmed = {name: run.warm_up() for name, run in runs.items()}
        for name, run in runs.items():  # as many steps everywhere: the same weights and batches
            for _ in range(max(warmed.values()) - warmed[name]):
                run.step()

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        sync()
        periods: dict[str, list[float]] = {name: [] for name in SCHEDULES}
        progress = _progress(rounds) if reporter else None
        for run in runs.values():
            run.timelines = []
        before = measure.Usage.now()
        for r in range(rounds):
            for name in SCHEDULES if r % 2 == 0 else reversed(SCHEDULES):
                periods[name].append(measure.steady_period(runs[name].step, STEPS_PER_ROUND, SETTLE_STEPS, sync))
            if progress is not None:
                progress.update()
        usage = measure.Usage.now().since(before)
        gathered: list = [None] * layout.ranks
        medians = {name: profile.action_medians(run.timelines) for name, run in runs.items()}
        loops = {name: measure.median(run.loop_s) for name, run in runs.items()}
        # the last stage's rank has each schedule's loss (rank 0 where the race chose a V)
        own_losses = {name: None if run.loss is None else run.loss.item() for name, run in runs.items()}
        dist.all_gather_object(gathered, (usage.own_cpu_s, medians, loops, own_losses))
        if progress is not None:
            progress.close()
        if reporter:
            predicted = predicted_gains(
                runs,
                {name: [part[1][name] for part in gathered] for name in SCHEDULES},
                {name: max(part[2][name] for part in gathered) for name in SCHEDULES},  # the slowest rank's
            )
            others = measure.others_cores(usage.wall_s, usage.machine_busy_s, [part[0] for part in gathered])
            summary = summarize(periods, predicted, others, layout.spare_cores)
            losses = {name: next((p[3][name] for p in gathered if p[3][name] is not None), None) for name in SCHEDULES}
            print("\n" + "\n".join(summary.lines(layout, losses)), flush=True)
            _write_pictures(out_dir)
        dist.barrier()  # every rank leaves together, none while the reporter still works
    finally:
        dist.destroy_process_group()


def _progress(rounds: int):
    from tqdm import tqdm

    return tqdm(total=rounds, desc=f"{' vs '.join(SCHEDULES)}, rounds", unit="round")


def _write_pictures(out_dir: str) -> None:
    from zbcompile.inspect.html import write_compared_png, write_report
    from zbcompile.inspect.read import load

    dumps = [load(os.path.join(out_dir, "dump", name)) for name in SCHEDULES]
    page = write_report(dumps[-1], os.path.join(out_dir, "report.html"), compared=dumps[:-1])
    png = write_compared_png(dumps, os.path.join(out_dir, "timelines.png"))
    print(f"report: {page} (both schedules' measured steps, bubbles shaded); picture: {png}")
    print(f"dumps (graphs, schedules, trace.json for Perfetto): {os.path.join(out_dir, 'dump')}; "
          "summary: zbcompile inspect DIR")


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"zbcompile demo: --rounds must be at least 1, got {args.rounds}")
    layout = choose_layout()
    size = size_model(layout, lambda hidden: measured_block_seconds(hidden, layout))
    print(f"{layout.describe()}; {size.describe()}", flush=True)
    out_dir = args.out or tempfile.mkdtemp(prefix="zbcompile-demo-")
    shutil.rmtree(os.path.join(out_dir, "dump"), ignore_errors=True)  # the previous run's
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(
        _rank_main, args=(layout, size, free_port(), out_dir, args.rounds), nprocs=layout.ranks, start_method="spawn"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="zero bubble against 1F1B on this machine, one pipeline rank per core")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="measurement rounds (each times both schedules)")
    parser.add_argument("--out", default="zbcompile_demo", help="where the report, the picture and the dumps go")
    parser.set_defaults(func=run)
