"""Training-step throughput on CPU: zbcompile's schedules beside torch.distributed.pipelining's,
on the same GPT, 2 gloo ranks with one thread each, m in {4, 8, 16} microbatches, in one run,
and where the time goes.

zbcompile's zb-auto runs with the pipeline's default options (its first compile measures, may re-cut,
in-line or a V, and races its schedule on real steps; it follows readiness); zbcompile's fixed
schedules (1f1b, zb-h1, zb-h2, zbv) run on the hand cut torch's 1F1B and GPipe get (two stages at
the middle block; zbv's four chunks even). Beside it, for the record of what each default brings:
zb-auto(static costs) (`profile=False`) and zb-auto(plan order) (`follow_readiness=False`); and
zb-h2(twin), a second zb-h2 pipeline identical to the first: the ratio of the two, paired like
every other, is the noise floor of the comparison itself (printed, not a target).
torch: ScheduleGPipe, Schedule1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV (`--all` adds
ScheduleInterleavedZeroBubble).

The model is sized from a measured step: the rows per microbatch are chosen so that a zbcompile
1f1b step at the smallest m takes about `step_target_s` on the machine as it is now (a guess
from the GPT's eager forward and backward, then a few timed steps of that pipeline): 0.1-0.4 s
per step over m = 4..16, whatever the machine's speed.

Every (library, schedule, m) pipeline is built up front in both ranks and warmed up (zb-auto
until it switched to its measured schedule); then rounds alternate between them (the order
reverses every other round), so that the machine's changing load falls on all of them alike.
Per round and pipeline: one step between two barriers (its makespan), then steps back to back
with the optimizer step in between, as a training loop runs them (steps/s: the steady-state
rate once the first steps have settled). Each round also records how much CPU other jobs took
meanwhile (machine busy time from /proc/stat minus both ranks' own CPU time).

Reported per schedule: steps/s; the ratios to torch's best schedule and to zbcompile's 1f1b
paired within each round (the median over rounds of the two step times' ratio); for zbcompile,
the simulator's predicted steady-state gain over 1f1b (spans, under the per-action medians this
pipeline measured), the measured gain over 1f1b, and their ratio, the captured share
(measured - 1) / (predicted - 1); the runtime's own time between actions (runtime gaps); the W
that ran elsewhere than the plan put them.

`--model llama` runs the same comparison on a Llama-style decoder instead (benchmarks/llama_style.py:
RMSNorm, rotary embeddings computed in each attention's forward, SwiGLU, an untied head; 8 layers,
hidden 256, vocab 512, seq 128; m = 4 and 8), a model no test contains; the report adds what
zb-auto's first compile measured, which cut it chose (in-line or a V, `runtime/tuning/recut.py`) and
how its schedule race went (`runtime/tuning/schedule_race.py`).

Targets, for both models and every m ("never behind", `NEVER_BEHIND`): zb-auto at least 1.00x
torch's best and 0.98x our best fixed schedule (1f1b, zb-h1, zb-h2, zbv), its step within 5% of
its busy-time bound (the slowest rank's summed action medians); our 1f1b at least 0.98x torch's.

    python benchmarks/runtime_cpu.py                 # ~6 minutes on 2 quiet cores
    python benchmarks/runtime_cpu.py --model llama   # the Llama-style decoder
    python benchmarks/runtime_cpu.py --model tiny-llama   # the same at d=96, seq 32, m=16: host time shows
    python benchmarks/runtime_cpu.py --quick         # a smoke run (with --model llama: the decoder, small)

Writes benchmarks/results/runtime_cpu.{json,md} (runtime_cpu_MODEL.{json,md} for the others).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))

import _launch  # noqa: E402
from zbcompile import measure  # noqa: E402
from zbcompile.inspect.decisions_text import race_lines  # noqa: E402
from zbcompile.rehearsal_torch import MULTI_CHUNK, chunk_ranks, torch_step  # noqa: E402

FIXED = ("1f1b", "zb-h1", "zb-h2", "zbv")  # our schedules zb-auto must never be behind
TWIN = "zb-h2(twin)"  # a second zb-h2 pipeline, identical: what the pairing itself reads between equals
ZB_SCHEDULES = (*FIXED, "zb-auto", "zb-auto(static costs)", "zb-auto(plan order)", TWIN)
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
MORE_ZB, MORE_TORCH = (), ("ScheduleInterleavedZeroBubble",)
# zbcompile variants: (schedule, pipeline options besides the defaults)
VARIANTS = {
    "zb-auto(static costs)": ("zb-auto", {"profile": False}),
    "zb-auto(plan order)": ("zb-auto", {"follow_readiness": False}),
    TWIN: ("zb-h2", {}),
}
MAX_SWITCH_STEPS = 400  # warm-up steps zb-auto may take to switch to its measured schedule


@dataclass(frozen=True)
class Settings:
    vocab: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    rows: int = 3  # rows (sequences) per microbatch, unless sized from a measured step
    step_target_s: float | None = 0.1  # size `rows` so that a 1f1b step at the smallest m takes about this
    microbatches: tuple[int, ...] = (4, 8, 16)
    warmup: int = 2
    rounds: int = 6
    steps_per_round: int = 5  # back-to-back steps per round (after one step between barriers)
    settle_steps: int = 2  # of those, the first ones the steady-state period leaves out
    lr: float = 1e-3
    timeout_s: float = 600.0
    zb_schedules: tuple[str, ...] = ZB_SCHEDULES
    torch_schedules: tuple[str, ...] = TORCH_SCHEDULES
    quiet_share: float = 0.5  # medians over this share of each pipeline's rounds, the quietest ones
    model: str = "gpt"  # "gpt": the zoo GPT; "llama", "tiny-llama": benchmarks/llama_style.py (`SHAPES`)
    device: str = "cpu"  # where each rank computes: "cpu", or "cuda" (cuda:LOCAL_RANK, benchmarks/gpu_pipelines.py)
    dtype: str = "float32"  # the model's parameters and activations


# --- the model, cut by hand for torch.distributed.pipelining ---------------------------------


MODEL_NAMES = {
    "gpt": "GPT (untied embeddings)",
    "llama": "Llama-style (RMSNorm, rotary, SwiGLU, untied head)",
    "tiny-llama": "Llama-style, tiny (actions of a few ms: the runtimes' own time per action shows)",
}
# zb-auto never behind: against torch's best, against our best fixed schedule (`FIXED`), and its
# step against its busy-time bound (the slowest rank's summed action medians); our 1F1B against torch's
NEVER_BEHIND = {"torch": 1.00, "ours": 0.98, "bound": 1.05, "1f1b": 0.98}
LLAMA = dict(vocab=512, seq_len=128, hidden=256, heads=4, layers=8, microbatches=(4, 8))  # the held-out shape
SHAPES = {  # per model other than the GPT: its shape, microbatches, and rows per microbatch (None: sized)
    "llama": (LLAMA, None),
    "tiny-llama": (dict(vocab=512, seq_len=32, hidden=96, heads=4, layers=8, microbatches=(16,)), 1),
}


def _gpt(settings: Settings):
    """The benchmark's model: the zoo GPT (untied embeddings), or the Llama-style decoder."""
    if settings.model in SHAPES:
        import llama_style

        return llama_style.llama_style(settings)
    return _launch.gpt(settings, tie_embeddings=False)


def _chunk_class(settings: Settings):
    """The module torch's pipelining runs a chunk of the model as."""
    if settings.model in SHAPES:
        import llama_style

        return llama_style.Chunk
    import torch
    from torch import nn

    class Chunk(nn.Module):
        """Blocks [lo, hi) of a GPT, with the embeddings in front on the first chunk and the
        final LayerNorm and LM head behind on the last one (the GPT's own modules, not copies)."""

        def __init__(self, gpt, lo: int, hi: int, first: bool, last: bool) -> None:
            super().__init__()
            self.first, self.last = first, last
            if first:
                self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
            self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
            if last:
                self.ln_f, self.head = gpt.ln_f, gpt.head

        def forward(self, x):
            if self.first:
                positions = torch.arange(x.shape[1], device=x.device)
                x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
            for block in self.blocks:
                x = block(x)
            if self.last:
                x = self.head(self.ln_f(x))
            return x

    return Chunk


def _even_split_points(layers: int, stages: int) -> list[str]:
    """Where `stages` stages of `layers` blocks begin, evenly (the hand cut torch's schedules get)."""
    if layers % stages:
        raise ValueError(f"{layers} layers do not split into {stages} stages")
    return [f"blocks.{s * layers // stages}" for s in range(1, stages)]


def _rank_device(kind: str):
    """This rank's device: the CPU, or cuda:LOCAL_RANK (torchrun's)."""
    import os

    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if kind == "cuda" else torch.device("cpu")


# --- one pipeline of either library, as a rank sees it ----------------------------------------


class ZbPipeline:
    def __init__(self, name: str, m: int, settings: Settings, tokens, targets) -> None:
        import torch
        import torch.distributed as dist

        import zbcompile
        from zbcompile.models.gpt import lm_loss
        from zbcompile.schedules import schedule_spec

        schedule, options = VARIANTS.get(name, (name, {}))
        self.model = _gpt(settings).to(getattr(torch, settings.dtype))
        stages = dist.get_world_size() * schedule_spec(schedule).chunks_per_rank
        self.pipe = zbcompile.pipeline(
            self.model,
            stages=stages,
            microbatches=m,
            loss_fn=lm_loss,
            schedule=schedule,
            split_points=None if schedule == "zb-auto" else _even_split_points(settings.layers, stages),
            timeout=settings.timeout_s,
            **options,
        )
        self.pipe.compile(tokens, target=targets)
        self.optimizer = torch.optim.SGD(self.pipe.parameters(), lr=settings.lr)
        self.tokens, self.targets = tokens, targets
        self.warmup = settings.warmup
        self.samples: list[list[dict]] = []  # per round, per settled back-to-back step: timeline and waits
        self.moved: list[dict] = []  # per timed step: W moved into waits, past sends
        self.switch_steps: int | None = None  # warm-up steps until zb-auto ran its measured schedule
        self._waits: list[tuple[str, float, float]] = []
        transport = self.pipe.runner.transport
        original = transport.wait

        def timed_wait(pending, waiting_action):
            started = time.perf_counter()
            result = original(pending, waiting_action)
            self._waits.append((waiting_action, started, time.perf_counter()))
            return result

        transport.wait = timed_wait

    def warm_up(self, barrier_step) -> None:
        """The warm-up steps; a pipeline measuring its costs then runs until it switched to its
        measured schedule (every rank switches after the same step), and two steps more."""
        for _ in range(self.warmup):
            barrier_step(self)
        if self.pipe.tuner is None:
            return
        steps = 0
        tuner = self.pipe.tuner
        while not tuner.settled and steps < MAX_SWITCH_STEPS:
            self.step()
            self.optimize()
            steps += 1
        self.switch_steps = steps
        for _ in range(2):
            barrier_step(self)

    def step(self) -> None:
        self._waits = []
        self.pipe.step(self.tokens, target=self.targets)
        moved = self.pipe.runner.moved_w
        self.moved.append({"into_wait": len(moved["into_wait"]), "past_send": len(moved["past_send"])})

    def new_round(self) -> None:
        self.samples.append([])

    def record(self) -> None:
        self.samples[-1].append({"timeline": list(self.pipe.runner.timeline), "waits": list(self._waits)})

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TorchPipeline:
    def __init__(self, name: str, m: int, settings: Settings, tokens, targets) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        from zbcompile.models.gpt import lm_loss

        ranks, rank = dist.get_world_size(), dist.get_rank()
        chunks = 2 * ranks if name in MULTI_CHUNK else ranks
        if settings.layers % chunks:
            raise ValueError(f"{settings.layers} layers do not split into {chunks} chunks")
        per = settings.layers // chunks
        owner = chunk_ranks(name, chunks, ranks)
        device = _rank_device(settings.device)
        gpt = _gpt(settings).to(getattr(torch, settings.dtype))
        Chunk = _chunk_class(settings)
        self.modules = [
            Chunk(gpt, c * per, (c + 1) * per, c == 0, c == chunks - 1).to(device)
            for c in range(chunks)
            if owner[c] == rank
        ]
        mine = [c for c in range(chunks) if owner[c] == rank]
        stages = [pipelining.PipelineStage(module, c, chunks, device) for module, c in zip(self.modules, mine)]
        cls = getattr(pipelining, name)
        self.schedule = cls(stages[0] if name not in MULTI_CHUNK else stages, m, loss_fn=lm_loss)
        self.has_first, self.has_last = 0 in mine, chunks - 1 in mine
        self.warmup = settings.warmup
        params = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=settings.lr)
        self.tokens, self.targets = tokens, targets

    def step(self) -> None:
        torch_step(self.schedule, self.tokens, self.targets, self.has_first, self.has_last)

    def new_round(self) -> None:
        pass

    def record(self) -> None:
        pass

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _calibrated_rows(settings: Settings) -> tuple[int, float]:
    """Rows per microbatch for which zbcompile's 1f1b step at the smallest m takes about
    `step_target_s` on this machine now: a first guess from the GPT's eager forward + backward,
    then a few steps of that pipeline, timed, scale it (rank 0's choice, shared). Also the
    measured step time of the guess."""
    import torch
    import torch.distributed as dist

    from zbcompile.models.gpt import lm_loss

    model = _gpt(settings)
    tokens = torch.randint(0, settings.vocab, (8, settings.seq_len), generator=torch.Generator().manual_seed(0))
    samples = []
    for _ in range(4):
        started = time.perf_counter()
        lm_loss(model(tokens), tokens.roll(-1, 1)).backward()
        samples.append(time.perf_counter() - started)
    m = min(settings.microbatches)
    # p=2: (m + 1) forward-backward slots of one stage (half the model) per 1F1B step
    box = [max(1, round(2 * settings.step_target_s / ((m + 1) * statistics.median(samples[1:]) / 8)))]
    dist.broadcast_object_list(box, src=0)
    guess = box[0]
    tokens = torch.randint(0, settings.vocab, (m * guess, settings.seq_len), generator=torch.Generator().manual_seed(0))
    pipeline = ZbPipeline("1f1b", m, replace(settings, rows=guess), tokens, tokens.roll(-1, 1))
    steps = []
    for _ in range(5):
        dist.barrier()
        started = time.perf_counter()
        pipeline.step()
        pipeline.optimize()
        steps.append(time.perf_counter() - started)
    measured = statistics.median(steps[1:])
    box = [(max(1, round(guess * settings.step_target_s / measured)), measured)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    calibration_step_s = None
    if settings.step_target_s is not None:
        rows, calibration_step_s = _calibrated_rows(settings)
        settings = replace(settings, rows=rows)
    pipelines: dict[tuple[str, str, int], object] = {}
    build_s: dict[str, float] = {}
    _share_compilation()
    for m in settings.microbatches:
        generator = torch.Generator().manual_seed(m)
        tokens = torch.randint(0, settings.vocab, (m * settings.rows, settings.seq_len), generator=generator)
        targets = tokens.roll(-1, 1)
        for name in settings.zb_schedules:
            started = time.perf_counter()
            pipelines[("zbcompile", name, m)] = ZbPipeline(name, m, settings, tokens, targets)
            build_s[f"zbcompile {name} m={m}"] = time.perf_counter() - started
        for name in settings.torch_schedules:
            started = time.perf_counter()
            pipelines[("torch", name, m)] = TorchPipeline(name, m, settings, tokens, targets)
            build_s[f"torch {name} m={m}"] = time.perf_counter() - started
    if rank == 0:
        print(
            f"{settings.rows} rows per microbatch; built {len(pipelines)} pipelines in {sum(build_s.values()):.0f} s",
            flush=True,
        )

    def barrier_step(pipeline) -> float:
        """One step between two barriers: its makespan."""
        dist.barrier()
        started = time.perf_counter()
        pipeline.step()
        dist.barrier()
        elapsed = time.perf_counter() - started
        pipeline.optimize()
        return elapsed

    def back_to_back(pipeline, steps: int) -> float:
        """The steady-state period of `steps` training steps (step, optimizer step) run as a
        training loop runs them, with barriers only around the whole run: seconds between the
        ends of this rank's steps, after the first `settle_steps` (which still feel the barrier
        that lined the ranks up)."""
        settle = min(settings.settle_steps, steps - 1)
        pipeline.new_round()
        dist.barrier()
        ends = [time.perf_counter()]
        for i in range(steps):
            pipeline.step()
            if i >= settle:
                pipeline.record()  # the runtime's timeline of a settled step
            pipeline.optimize()
            ends.append(time.perf_counter())
        dist.barrier()
        return (ends[-1] - ends[settle]) / (steps - settle)

    keys = list(pipelines)
    warm_started = time.perf_counter()
    for key in keys:
        if isinstance(pipelines[key], ZbPipeline):
            pipelines[key].warm_up(barrier_step)
        else:
            for _ in range(pipelines[key].warmup):  # torch infers shapes on its first step
                barrier_step(pipelines[key])
    for key in keys:
        if isinstance(pipelines[key], ZbPipeline):
            pipelines[key].moved.clear()
    if rank == 0:
        print(f"warmed up in {time.perf_counter() - warm_started:.0f} s", flush=True)
    times: dict[tuple, list[float]] = defaultdict(list)
    barrier_times: dict[tuple, list[float]] = defaultdict(list)
    # per measurement: wall seconds, this rank's CPU seconds (all its threads), and on rank 0 the
    # whole machine's busy CPU seconds, to tell how much of the cores other jobs took meanwhile
    usage: dict[tuple, list[measure.Usage]] = defaultdict(list)
    loads = [_launch.machine()["loadavg_1_5_15"][0]]
    for r in range(settings.rounds):
        for key in keys if r % 2 == 0 else reversed(keys):
            dist.barrier()
            before = measure.Usage.now()
            barrier_times[key].append(barrier_step(pipelines[key]))
            times[key].append(back_to_back(pipelines[key], settings.steps_per_round))
            usage[key].append(measure.Usage.now().since(before))
        loads.append(_launch.machine()["loadavg_1_5_15"][0])
        if rank == 0:
            print(f"round {r + 1}/{settings.rounds} done, load {loads[-1]:.2f}", flush=True)
    result = {
        "times": dict(times), "barrier_times": dict(barrier_times), "usage": dict(usage), "loads": loads,
        "build_s": build_s, "rows": settings.rows, "calibration_step_s": calibration_step_s, "zb": {},
    }
    for key, pipeline in pipelines.items():
        if isinstance(pipeline, ZbPipeline):
            schedule = pipeline.pipe.schedule
            tuner = pipeline.pipe.tuner
            result["zb"][key] = {
                "samples": pipeline.samples,
                "schedule": schedule,
                "moved": pipeline.moved,
                "switch_steps": pipeline.switch_steps,
                "tuner_history": list(tuner.history) if tuner is not None else [],
                "cost_source": schedule.info.get("cost_source"),
                "local_stages": pipeline.pipe.runner.local_stages,
                "cut_record": pipeline.pipe.compiled.cut_record,
            }
    return result


def _share_compilation() -> None:
    """Compile each microbatch shape once per rank and share the result between the schedules
    of that shape: the compiled stage graphs do not depend on the schedule (nor on the model
    instance: the runtime looks parameters up by name), so this changes only the set-up time."""
    from zbcompile.runtime import build

    original = build.compile_pipeline
    cache: dict = {}

    def compile_once(model, loss_fn, args, kwargs, target, stages, split_points=None, device=None, **options):
        key = (
            tuple((tuple(a.shape), a.dtype) for a in args),
            tuple(target.shape),
            stages,
            tuple(split_points or ()),
            str(device),
            tuple(sorted(options.items())),
        )
        if key not in cache:
            cache[key] = original(model, loss_fn, args, kwargs, target, stages, split_points, device, **options)
        return cache[key]

    build.compile_pipeline = compile_once


# --- analysis ---------------------------------------------------------------------------------


def _durations(per_rank: list[dict], key, rounds: list[int]) -> tuple[dict, list[float], list[float], int]:
    """From the timelines of every settled back-to-back step of `rounds`: each (stage, kind)'s
    compute times (the time an action waited for a message taken out), the
    message latencies that could be observed, per step the largest per-rank sum of gaps between
    consecutive actions that were not waits (the runtime's own work between actions: posting
    sends and receives, bookkeeping), and the actions per rank and step."""
    from zbcompile.schedules import Action

    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    latencies: list[float] = []
    gaps: list[float] = []
    actions = 0
    steps = [(r, i) for r in rounds for i in range(len(per_rank[0]["zb"][key]["samples"][r]))]
    for r, i in steps:
        end_of: dict[tuple[int, str, int], float] = {}
        wait_of: dict[str, tuple[float, float]] = {}
        step_gaps = []
        for rank_result in per_rank:
            sample = rank_result["zb"][key]["samples"][r][i]
            rank_waits = {a: (s, e) for a, s, e in sample["waits"]}
            previous_end = None
            gap = 0.0
            timeline = sorted(sample["timeline"], key=lambda e: e[1])
            actions = max(actions, len(timeline))
            for text, start, end in timeline:
                action = Action.parse(text)
                waited = rank_waits.get(text)
                # runtimes that start an action's clock before its wait count the wait in: take it out
                overlap = max(0.0, min(end, waited[1]) - max(start, waited[0])) if waited else 0.0
                durations[(action.stage, action.kind)].append((end - start) - overlap)
                end_of[(action.stage, "I" if action.kind == "B" else action.kind, action.microbatch)] = end
                if previous_end is not None:
                    outside = max(0.0, min(start, waited[1]) - max(previous_end, waited[0])) if waited else 0.0
                    gap += max(0.0, start - previous_end - outside)
                previous_end = end
            step_gaps.append(gap)
            wait_of.update(rank_waits)
        gaps.append(max(step_gaps))
        # latency of a message: from its producer's end to the end of a wait that had begun
        # before it (a message that arrived before it was needed does not show its latency)
        for text, (start, end) in wait_of.items():
            action = Action.parse(text)
            producer = (
                (action.stage - 1, "F", action.microbatch)
                if action.kind == "F"
                else (action.stage + 1, "I", action.microbatch)
            )
            if producer in end_of and start <= end_of[producer]:
                latencies.append(max(0.0, end - end_of[producer]))
    return durations, latencies, gaps, actions


def _costs(stat: dict, stages: int, comm: float):
    """Costs per stage from one statistic of each action kind: I and W where the schedule split
    the backward, else the fused B as i with w = 0 (a fused B costs i + w either way)."""
    from zbcompile.schedules import Costs

    f, i, w = [], [], []
    for s in range(stages):
        f.append(stat.get((s, "F"), 0.0))
        if (s, "I") in stat:
            i.append(stat[(s, "I")])
            w.append(stat.get((s, "W"), 0.0))
        else:
            i.append(stat.get((s, "B"), 0.0))
            w.append(0.0)
    return Costs(f=f, i=i, w=w, comm=comm)


def predict(per_rank: list[dict], key, rounds: list[int]) -> dict:
    """The simulator's makespan and span for the schedule that ran, from the per-action medians
    measured in `rounds`, and 1F1B simulated under the same costs: the most this schedule could
    gain over it between barriers (makespans) and back to back (spans, the steady-state gain)."""
    from zbcompile.schedules import make_schedule, simulate
    from zbcompile.schedules.costs import resolve_costs

    schedule = per_rank[0]["zb"][key]["schedule"]
    durations, latencies, gaps, actions = _durations(per_rank, key, rounds)
    comm = _launch.median(latencies) if latencies else 0.0
    medians = {k: _launch.median(v) for k, v in durations.items()}
    costs = _costs(medians, schedule.stages, comm)
    sim = simulate(schedule, costs)
    # 1F1B on the same ranks: a V's chunks 2r and 2r+1 make rank r's stage
    in_line = resolve_costs(costs, schedule.stages).merged(schedule.stages // schedule.ranks)
    one_f_one_b = simulate(make_schedule("1f1b", schedule.ranks, schedule.microbatches, check=False), in_line)
    return {
        "f_ms": [1e3 * x for x in costs.f],
        "b_ms": [1e3 * x for x in costs.i],
        "w_ms": [1e3 * x for x in costs.w],
        "comm_ms": 1e3 * comm,
        "makespan_ms": 1e3 * sim.makespan,
        "span_ms": 1e3 * sim.span,
        "busy_ms": [
            1e3
            * sum(
                costs.f[s] + costs.i[s] + costs.w[s] for s in range(schedule.stages) if schedule.stage_to_rank[s] == r
            )
            * schedule.microbatches
            for r in range(schedule.ranks)
        ],
        "simulated_gain_over_1f1b": one_f_one_b.makespan / sim.makespan,
        "simulated_steady_gain_over_1f1b": one_f_one_b.span / sim.span,
        "runtime_gaps_ms": 1e3 * _launch.median(gaps),
        "runtime_gap_per_action_us": 1e6 * _launch.median(gaps) / max(actions, 1),
    }


def others_cores(per_rank: list[dict], key) -> list[float]:
    """Per round: cores' worth of CPU that other jobs used while this pipeline was measured
    (machine busy time minus both ranks' own CPU time, over the wall time)."""
    rounds = zip(*(r["usage"][key] for r in per_rank))  # rank 0 reads the machine's busy time
    return [
        measure.others_cores(usages[0].wall_s, usages[0].machine_busy_s, [u.own_cpu_s for u in usages])
        for usages in rounds
    ]


def _select(per_rank: list[dict], settings: Settings) -> tuple[dict, dict, dict, str]:
    """The rounds the medians use: for every pipeline, the `quiet_share` of its rounds in which
    other jobs used the least CPU (all rounds when quiet_share is 1)."""
    keys = list(per_rank[0]["times"])
    chosen = {}
    for k in keys:
        others = others_cores(per_rank, k)
        keep = max(1, math.ceil(settings.quiet_share * len(others)))
        chosen[k] = sorted(sorted(range(len(others)), key=lambda i: others[i])[:keep])
    times = {k: [per_rank[0]["times"][k][i] for i in chosen[k]] for k in keys}
    barrier = {k: [per_rank[0]["barrier_times"][k][i] for i in chosen[k]] for k in keys}
    if settings.quiet_share >= 1:
        note = "medians over all rounds"
    else:
        note = (
            f"steps/s and ms/step: medians over the quietest {settings.quiet_share:.0%} of each pipeline's rounds "
            "(those in which other jobs used the least CPU); the all-rounds median beside them"
        )
    return times, barrier, chosen, note


def analyse(per_rank: list[dict], settings: Settings, machine_before: dict, machine_after: dict, wall_s: float) -> dict:
    settings = replace(settings, rows=per_rank[0]["rows"])
    times, barrier_times, chosen, selection = _select(per_rank, settings)
    all_times, all_barrier = per_rank[0]["times"], per_rank[0]["barrier_times"]
    rows = []
    for m in settings.microbatches:
        keys = [k for k in times if k[2] == m]
        loop = {k: _launch.median(times[k]) for k in keys}
        barrier = {k: _launch.median(barrier_times[k]) for k in keys}
        torch_keys = [k for k in keys if k[0] == "torch"]
        best = min(torch_keys, key=loop.get)
        one_f_one_b = ("zbcompile", "1f1b", m)
        ours_best = min((k for k in keys if k[0] == "zbcompile" and k[1] in FIXED), key=loop.get)

        def paired(reference, key) -> float:
            return measure.paired_ratio(all_times[reference], all_times[key])

        for key in keys:
            lib, name, _ = key
            row = {
                "library": lib,
                "schedule": name,
                "m": m,
                "step_ms": 1e3 * loop[key],
                "steps_per_s": 1.0 / loop[key],
                "step_ms_all_rounds": 1e3 * _launch.median(all_times[key]),
                "vs_torch_best": paired(best, key),
                "vs_zbcompile_1f1b": paired(one_f_one_b, key),
                "vs_torch_1f1b": paired(("torch", "Schedule1F1B", m), key)
                if ("torch", "Schedule1F1B", m) in keys
                else None,
                "medians_vs_torch_best": loop[best] / loop[key],
                "torch_best": best[1],
                "barrier_step_ms": 1e3 * barrier[key],
                "barrier_step_ms_all_rounds": 1e3 * _launch.median(all_barrier[key]),
                "rounds_used": chosen[key],
                "others_cores": others_cores(per_rank, key),
                "step_ms_samples": [1e3 * t for t in all_times[key]],
            }
            if lib == "zbcompile":
                zb = per_rank[0]["zb"][key]
                prediction = predict(per_rank, key, chosen[key])
                predicted = prediction["simulated_steady_gain_over_1f1b"]
                row["prediction"] = prediction
                row["busy_bound_ms"] = max(prediction["busy_ms"])
                row["over_bound"] = row["step_ms"] / row["busy_bound_ms"]
                row["vs_ours_best"] = paired(ours_best, key)
                row["ours_best"] = ours_best[1]
                row["captured_share"] = (row["vs_zbcompile_1f1b"] - 1) / (predicted - 1) if predicted > 1.005 else None
                row["barrier_over_makespan"] = row["barrier_step_ms"] / prediction["makespan_ms"]
                row["cost_source"] = zb["cost_source"]
                row["placement"] = _launch.placement(zb["schedule"])
                row["switch_steps"] = zb["switch_steps"]
                row["tuner_history"] = [r["zb"][key]["tuner_history"] for r in per_rank][0]
                row["cut_record"] = zb.get("cut_record")
                row["w_into_wait_per_step"] = [
                    statistics.fmean(x["into_wait"] for x in r["zb"][key]["moved"]) for r in per_rank
                ]
                row["w_past_send"] = [r["zb"][key]["moved"][-1]["past_send"] for r in per_rank]
                row["schedule_actions"] = [" ".join(str(a) for a in r) for r in zb["schedule"].compute_only().actions]
            rows.append(row)
    noise_floor = {  # m -> the twin's steps/s over zb-h2's, paired as every ratio here is
        m: measure.paired_ratio(all_times[("zbcompile", "zb-h2", m)], all_times[("zbcompile", TWIN, m)])
        for m in settings.microbatches
        if ("zbcompile", TWIN, m) in all_times and ("zbcompile", "zb-h2", m) in all_times
    }
    targets = []
    wanted = NEVER_BEHIND
    for m in settings.microbatches:
        by = {r["schedule"]: r for r in rows if r["m"] == m and r["library"] == "zbcompile"}
        auto, ours = by["zb-auto"], by["1f1b"]
        targets += [
            {"m": m, "target": f"zb-auto steps/s >= {wanted['torch']:.2f}x torch's best (paired)",
             "value": auto["vs_torch_best"], "holds": auto["vs_torch_best"] >= wanted["torch"]},
            {"m": m, "value": auto["vs_ours_best"], "holds": auto["vs_ours_best"] >= wanted["ours"],
             "target": f"zb-auto steps/s >= {wanted['ours']:.2f}x our best fixed ({auto['ours_best']}, paired)"},
            {"m": m, "target": f"zb-auto step <= {wanted['bound']:.2f}x its busy-time bound",
             "value": auto["over_bound"], "holds": auto["over_bound"] <= wanted["bound"]},
        ]
        if ours["vs_torch_1f1b"] is not None:
            targets.append(
                {
                    "m": m,
                    "target": f"zbcompile 1f1b steps/s >= {wanted['1f1b']:.2f}x torch's 1F1B (paired)",
                    "value": ours["vs_torch_1f1b"],
                    "holds": ours["vs_torch_1f1b"] >= wanted["1f1b"],
                }
            )
    return {
        "settings": asdict(settings),
        "calibration_step_s": per_rank[0]["calibration_step_s"],
        "selection": selection,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "load_during_rounds": per_rank[0]["loads"],
        "wall_s": wall_s,
        "build_s": per_rank[0]["build_s"],
        "rows": rows,
        "targets": targets,
        "noise_floor": noise_floor,
    }


def report(data: dict) -> str:
    s = data["settings"]
    rows = data["rows"]
    sizing = (
        f"{s['rows']} rows per microbatch, sized from a measured step (a first guess from the GPT's eager forward "
        f"+ backward took {data['calibration_step_s']:.2f} s per zbcompile 1f1b step at m={min(s['microbatches'])}) "
        f"so that such a step takes about {s['step_target_s']:.2f} s on this machine now"
        if data.get("calibration_step_s") else f"{s['rows']} rows per microbatch"
    )
    lines = [
        "# Training-step throughput on CPU: zbcompile beside torch.distributed.pipelining",
        "",
        f"{MODEL_NAMES[s.get('model', 'gpt')]} vocab {s['vocab']}, seq {s['seq_len']}, hidden {s['hidden']}, "
        f"heads {s['heads']}, "
        f"{s['layers']} layers; {sizing}; 2 gloo ranks, 1 thread each. zbcompile: 2 stages split at "
        f"blocks.{s['layers'] // 2}; zb-auto with the pipeline's defaults (the cut chosen by measurement in its first "
        "compile, one stage per rank or "
        "a V of two chunks per rank, costs measured over its first steps, readiness followed), zb-auto(static costs) "
        "with `profile=False`, zb-auto(plan order) with "
        "`follow_readiness=False`. torch: the same split for GPipe/1F1B, 4 chunks of "
        f"{s['layers'] // 4} block(s) for the 2-chunks-per-rank schedules.",
        f"{s['warmup']} warm-up steps per pipeline (untimed; zb-auto until it runs its measured schedule), then "
        f"{s['rounds']} rounds alternating over all pipelines (order reversed every other round); per round and "
        f"pipeline: one step between two barriers, then {s['steps_per_round']} steps back to back with the optimizer "
        f"step, as a training loop runs them (steps/s: the steady-state rate, from the end of step {s['settle_steps']} "
        "to the end of the last).",
        f"Machine: {_launch.load_line(data['machine_before'])} before, "
        f"{_launch.load_line(data['machine_after'])} after; 1-min load during the rounds "
        f"{min(data['load_during_rounds']):.1f} to {max(data['load_during_rounds']):.1f}. "
        f"Run took {data['wall_s']:.0f} s.",
        "",
        "## Steps per second",
        "",
        f"Other jobs' CPU use during each pipeline's rounds (cores, median over all pipelines and rounds): "
        f"{_launch.median([c for r in rows for c in r['others_cores']]):.2f}; {data['selection']}. Ratios are paired: "
        "the median over all rounds of the two pipelines' step-time ratio within each round (the machine's speed "
        "drifts between rounds; torch's best is the one with the best median).",
        "",
    ]
    lines.append(_launch.table(
        ["schedule", "m", "steps/s", "ms/step", "ms/step, all rounds", "vs torch best", "vs zbcompile 1f1b",
         "vs our best fixed", "vs torch 1F1B", "busy bound ms", "step / bound", "barrier step ms"],
        [
            [f"{r['library']} {r['schedule']}", r["m"], f"{r['steps_per_s']:.2f}", f"{r['step_ms']:.1f}",
             f"{r['step_ms_all_rounds']:.1f}", f"{r['vs_torch_best']:.2f}x", f"{r['vs_zbcompile_1f1b']:.2f}x",
             f"{r['vs_ours_best']:.2f}x" if "vs_ours_best" in r else "-",
             f"{r['vs_torch_1f1b']:.2f}x" if r["vs_torch_1f1b"] is not None else "-",
             f"{r['busy_bound_ms']:.1f}" if "busy_bound_ms" in r else "-",
             f"{r['over_bound']:.3f}" if "over_bound" in r else "-", f"{r['barrier_step_ms']:.1f}"]
            for r in rows
        ],
    ))
    lines += [
        "",
        "Busy bound: the slowest rank's summed per-action medians over a step (no schedule's period on these "
        "ranks can be shorter); step / bound: how far the measured step is above it.",
    ]
    bests = sorted({(r["m"], r["torch_best"]) for r in rows})
    lines += ["", "torch best: " + ", ".join(f"m={m}: {a}" for m, a in bests), ""]
    placed = [
        f"m={r['m']}: {r['placement']}" for r in rows if r["library"] == "zbcompile" and r["schedule"] == "zb-auto"
    ]
    lines += ["zb-auto's placement (one stage per rank: in-line; two chunks per rank: v): " + ", ".join(placed), ""]
    lines += [
        "## Where the time goes (zbcompile; per-action medians from the runtime's timelines of the settled steps of "
        "the rounds used)",
        "",
    ]
    lines.append(_launch.table(
        ["schedule", "m", "F ms (s0/s1)", "I or B ms", "W ms", "comm ms", "busy ms (r0/r1)", "simulated span ms",
         "ms/step", "predicted gain over 1f1b", "measured gain", "captured share", "runtime gaps ms",
         "gap per action us", "W into waits per step (r0/r1)", "W past sends (r0/r1)", "costs"],
        [
            [r["schedule"], r["m"],
             "/".join(f"{x:.1f}" for x in r["prediction"]["f_ms"]),
             "/".join(f"{x:.1f}" for x in r["prediction"]["b_ms"]),
             "/".join(f"{x:.1f}" for x in r["prediction"]["w_ms"]),
             f"{r['prediction']['comm_ms']:.2f}",
             "/".join(f"{x:.0f}" for x in r["prediction"]["busy_ms"]),
             f"{r['prediction']['span_ms']:.1f}", f"{r['step_ms']:.1f}",
             f"{r['prediction']['simulated_steady_gain_over_1f1b']:.3f}x", f"{r['vs_zbcompile_1f1b']:.3f}x",
             f"{r['captured_share']:.0%}" if r["captured_share"] is not None else "-",
             f"{r['prediction']['runtime_gaps_ms']:.1f}", f"{r['prediction']['runtime_gap_per_action_us']:.0f}",
             "/".join(f"{x:.1f}" for x in r["w_into_wait_per_step"]), "/".join(str(x) for x in r["w_past_send"]),
             r["cost_source"]]
            for r in rows if r["library"] == "zbcompile"
        ],
    ))
    lines += [
        "",
        "I or B: the input-gradient backward I where the schedule splits it, else the fused backward B with W = 0 "
        "(stage 0's I computes the activations' gradients, which it sends nowhere). Per-action times exclude waiting "
        "for a message; comm: median "
        "delay from a producer's end to the end of a receiver's wait that had begun before it. Busy: per rank, the sum "
        "of its "
        "actions' medians over a step (no schedule's period can be shorter than the larger one). Simulated span: the "
        "simulator's longest per-rank span under these costs, the period back-to-back steps approach. Predicted gain: "
        "1F1B's simulated span over this schedule's, both under this row's costs (the steady-state gain the simulator "
        "promises); measured gain: steps/s over zbcompile 1f1b's, paired per round; captured share: (measured - 1) / "
        "(predicted - 1). Runtime gaps: per step, the larger per-rank sum of the time between consecutive actions that "
        "was not a wait for a message (posting sends and receives, bookkeeping; the simulator has no such time), and "
        "per action. W into waits: W run early while a computation waited for a message, per step; past sends: W the "
        "program runs after a send the plan put them before. Costs: what the running schedule was solved with.",
        "",
        "## Targets",
        "",
    ]
    lines.append(_launch.table(
        ["m", "target", "measured", "holds"],
        [[t["m"], t["target"], f"{t['value']:.3f}", "yes" if t["holds"] else "NO"] for t in data["targets"]],
    ))
    if data.get("noise_floor"):
        lines += [
            "",
            "Noise floor (not a target): a second zb-h2 pipeline, identical to the first, measured "
            + ", ".join(f"{v:.3f}x at m={m}" for m, v in sorted(data["noise_floor"].items()))
            + " zb-h2's steps/s, paired the same way: a ratio between equals, the spread the targets above must clear.",
        ]
    switches = [
        (r["m"], r["schedule"], r["switch_steps"], r["tuner_history"])
        for r in rows
        if r["library"] == "zbcompile" and r["switch_steps"] is not None
    ]
    if switches:
        lines += ["", "## Measured costs", ""]
        for m, name, steps, history in switches:
            events = "; ".join(f"step {e['step']}: {e['event']}" for e in history)
            lines.append(f"- m={m} {name}: switched to its measured schedule after {steps} warm-up steps ({events})")
    cuts = [(r["m"], r["cut_record"]) for r in rows if r["schedule"] == "zb-auto" and r.get("cut_record")]
    if cuts:
        lines += ["", "## The cut by measurement (zb-auto's first compile)", ""]
        for m, cut in cuts:
            verdict = f"re-cut to {cut['chosen']['cut']}" if cut["changed"] else "kept"
            lines.append(
                f"- m={m}: measured {cut['measured']['cut']} ({'; '.join(cut['measured']['stages'])}), {verdict}; "
                f"predicted gain {cut['predicted_gain']:.3f}x; rank speeds "
                f"{', '.join(f'{x:.2f}' for x in cut['rank_speeds'])}; {cut['reason']}"
            )
            lines += [f"  {line}" for line in race_lines(cut.get("race"))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--steps-per-round", type=int, default=Settings.steps_per_round)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--microbatches", default=",".join(map(str, Settings.microbatches)))
    parser.add_argument(
        "--step-target",
        type=float,
        default=Settings.step_target_s,
        help="seconds a step at the smallest m should take (0: use --rows)",
    )
    parser.add_argument("--rows", type=int, default=Settings.rows)
    parser.add_argument(
        "--all", action="store_true", help="also torch's ScheduleInterleavedZeroBubble"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: m=4 only, 1 round, smaller model")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results files alone")
    parser.add_argument(
        "--model", choices=tuple(MODEL_NAMES), default="gpt",
        help="the zoo GPT, the Llama-style decoder (8 layers, d=256, vocab 512; m=4,8 unless --microbatches), or "
        "a tiny one (d=96, seq 32, one row per microbatch; m=16)",
    )
    options = parser.parse_args()
    shape, rows = SHAPES.get(options.model, ({}, None))
    microbatches = options.microbatches
    if shape and microbatches == ",".join(map(str, Settings.microbatches)):
        microbatches = ",".join(map(str, shape["microbatches"]))
    sized = rows is None and options.step_target
    settings = Settings(
        rounds=options.rounds, steps_per_round=options.steps_per_round, warmup=options.warmup,
        microbatches=tuple(int(m) for m in microbatches.split(",")), rows=rows or options.rows,
        step_target_s=options.step_target if sized else None, model=options.model,
        **{k: v for k, v in shape.items() if k != "microbatches"},
    )
    if options.all:
        settings = replace(settings, zb_schedules=ZB_SCHEDULES + MORE_ZB, torch_schedules=TORCH_SCHEDULES + MORE_TORCH)
    if options.quick:
        settings = Settings(
            hidden=32,
            seq_len=16,
            layers=4 if options.model == "gpt" else 8,
            microbatches=(4,),
            rounds=1,
            steps_per_round=3,
            warmup=1,
            step_target_s=None,
            model=options.model,
            vocab=settings.vocab,
        )
    name = "runtime_cpu" if options.model == "gpt" else f"runtime_cpu_{options.model}"
    _launch.run_and_report(
        name, 2, rank_main, settings, analyse, report, write=not options.no_write and not options.quick
    )


if __name__ == "__main__":
    main()
