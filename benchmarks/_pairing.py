"""Pipelines timed side by side, round by round ("pairing"): every round runs each pipeline once, in
an order that moves every round (each takes each place equally often), so that the machine's
changing load falls on all alike; the scripts take medians over rounds and paired ratios within a
round. Here: the rounds, the step timings, the rounds in which other jobs took the least CPU, the
costs and the simulator's prediction read off the runtime's timelines, and the pipelines of both
libraries as benchmarks/runtime_cpu.py and gpu_pipelines.py build them."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import _launch
from zbcompile import measure
from zbcompile.rehearsal.torch_schedules import MULTI_CHUNK, chunk_ranks, torch_step

MAX_SWITCH_STEPS = 400  # warm-up steps zb-auto may take to switch to its measured schedule


# --- rounds -----------------------------------------------------------------------------------


def order(keys: Sequence, r: int, rotate: bool = False) -> list:
    """`keys` in round `r`'s order: reversed every other round, or (`rotate`) begun `r` places on."""
    keys = list(keys)
    if rotate:
        return keys[r % len(keys) :] + keys[: r % len(keys)]
    return keys if r % 2 == 0 else keys[::-1]


def rounds(
    keys: Sequence, count: int, run: Callable[[Any], Any], rotate: bool = False,
    after: Callable[[int, dict], str | None] | None = None,
) -> dict[Any, list]:
    """Key -> what `run(key)` returned in each of `count` rounds, the keys in each round's `order`.
    After round r, `after(r, results so far)` runs, and rank 0 prints the line it returns."""
    results: dict[Any, list] = {key: [] for key in keys}
    for r in range(count):
        for key in order(keys, r, rotate):
            results[key].append(run(key))
        line = after(r, results) if after else None
        if line:
            _launch.say(line)
    return results


def between_barriers(run: Callable[[], Any], steps: int = 1) -> float:
    """Seconds per call of `run()` over `steps` calls back to back, a barrier before the first and
    after the last (so that every rank times the same calls)."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        run()
    dist.barrier()
    return (time.perf_counter() - started) / steps


def training_step(pipe: Any, optimizer: Any, tokens, targets, set_to_none: bool = True) -> Callable[[], None]:
    """One training step of zbcompile's `pipe` on `tokens`: the pipeline's step, then `optimizer`'s
    step and zero_grad."""

    def step() -> None:
        pipe.step(tokens, target=targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def slowest(per_rank: Iterable[Sequence[float]]) -> list[float]:
    """Per round, the largest of the ranks' times (a step ends when its slowest rank's does)."""
    return [max(times) for times in zip(*per_rank)]


class DeviceClock:
    """Time of work queued on `device`: calling the clock synchronises the device, then reads the
    host's clock; marks on the device's stream are CUDA events on a GPU, perf_counter readings on
    the CPU (which has run the work by then)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


# --- the pipelines of both libraries, as a rank sees them --------------------------------------


def model(settings: Any) -> nn.Module:
    """The model of benchmarks/runtime_cpu.py's `settings`: the zoo GPT (untied embeddings), or
    the Llama-style decoder (benchmarks/llama_style.py) where `settings.model` is not "gpt"."""
    if settings.model != "gpt":
        import llama_style

        return llama_style.llama_style(settings)
    return _launch.gpt(settings, tie_embeddings=False)


class GPTChunk(nn.Module):
    """Blocks [lo, hi) of a GPT, with the embeddings in front on the first chunk and the final
    LayerNorm and LM head behind on the last one (the GPT's own modules, not copies)."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def chunk_class(settings: Any) -> type[nn.Module]:
    """The module torch's pipelining runs a chunk of `model(settings)` as."""
    if settings.model != "gpt":
        import llama_style

        return llama_style.Chunk
    return GPTChunk


def even_split_points(layers: int, stages: int) -> list[str]:
    """Where `stages` stages of `layers` blocks begin, evenly (the hand cut torch's schedules get)."""
    if layers % stages:
        raise ValueError(f"{layers} layers do not split into {stages} stages")
    return [f"blocks.{s * layers // stages}" for s in range(1, stages)]


def rank_device(kind: str) -> torch.device:
    """This rank's device: the CPU, or cuda:LOCAL_RANK (torchrun's)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if kind == "cuda" else torch.device("cpu")


class Pipeline:
    """A pipeline in the rounds: `step()` (each library's), the optimizer step (SGD at
    `settings.lr`), the warm-up, and a round's two timings."""

    def __init__(self, parameters: Iterable, settings: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer = torch.optim.SGD(parameters, lr=settings.lr)
        self.tokens, self.targets = tokens, targets
        self.warmup = settings.warmup

    def step(self) -> None:
        raise NotImplementedError

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def new_round(self) -> None:
        """A round's back-to-back steps begin."""

    def record(self) -> None:
        """Keep what the step just run shows (a settled back-to-back step)."""

    def warm_up(self) -> None:
        """The untimed steps before the rounds (torch's pipelines infer shapes on their first)."""
        for _ in range(self.warmup):
            self.barrier_step()

    def barrier_step(self) -> float:
        """One step between two barriers: its makespan (the optimizer step after, untimed)."""
        elapsed = between_barriers(self.step)
        self.optimize()
        return elapsed

    def back_to_back(self, steps: int, settle: int) -> float:
        """The steady-state period of `steps` training steps (step, optimizer step) run as a
        training loop runs them, with barriers only around the whole run: seconds between the
        ends of this rank's steps, after the first `settle` (which still feel the barrier that
        lined the ranks up); the steps after those are `record`ed."""
        settle = min(settle, steps - 1)
        self.new_round()
        dist.barrier()
        ends = [time.perf_counter()]
        for i in range(steps):
            self.step()
            if i >= settle:
                self.record()
            self.optimize()
            ends.append(time.perf_counter())
        dist.barrier()
        return (ends[-1] - ends[settle]) / (steps - settle)


class ZbPipeline(Pipeline):
    """zbcompile's pipeline of `schedule` (with `options` besides the defaults): zb-auto cut where
    it measures, any other schedule at even blocks. Kept per round: each recorded step's runtime
    timeline and message waits (`samples`); per timed step: the W moved into waits or past sends."""

    def __init__(self, schedule: str, m: int, settings: Any, tokens, targets, **options: Any) -> None:
        import zbcompile
        from zbcompile.models.gpt import lm_loss
        from zbcompile.schedules import schedule_spec

        self.model = model(settings).to(getattr(torch, settings.dtype))
        stages = dist.get_world_size() * schedule_spec(schedule).chunks_per_rank
        self.pipe = zbcompile.pipeline(
            self.model, stages=stages, microbatches=m, loss_fn=lm_loss, schedule=schedule,
            split_points=None if schedule == "zb-auto" else even_split_points(settings.layers, stages),
            timeout=settings.timeout_s, **options,
        )
        self.pipe.compile(tokens, target=targets)
        super().__init__(self.pipe.parameters(), settings, tokens, targets)
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

    def warm_up(self) -> None:
        """The warm-up steps; a pipeline measuring its costs then runs until it switched to its
        measured schedule (every rank switches after the same step), and two steps more. The W
        the warm-up moved are not kept."""
        super().warm_up()
        tuner = self.pipe.tuner
        if tuner is not None:
            steps = 0
            while not tuner.settled and steps < MAX_SWITCH_STEPS:
                self.step()
                self.optimize()
                steps += 1
            self.switch_steps = steps
            for _ in range(2):
                self.barrier_step()
        self.moved.clear()

    def step(self) -> None:
        self._waits = []
        self.pipe.step(self.tokens, target=self.targets)
        moved = self.pipe.runner.moved_w
        self.moved.append({"into_wait": len(moved["into_wait"]), "past_send": len(moved["past_send"])})

    def new_round(self) -> None:
        self.samples.append([])

    def record(self) -> None:
        self.samples[-1].append({"timeline": list(self.pipe.runner.timeline), "waits": list(self._waits)})

    def kept(self) -> dict:
        """What the rounds leave to read: the recorded samples, the schedule that ran, the W moved,
        the warm-up steps to the switch, the tuner's history, where the running schedule's costs
        came from, this rank's stages and the record of the cut by measurement."""
        schedule, tuner = self.pipe.schedule, self.pipe.tuner
        return {
            "samples": self.samples, "schedule": schedule, "moved": self.moved, "switch_steps": self.switch_steps,
            "tuner_history": list(tuner.history) if tuner is not None else [],
            "cost_source": schedule.info.get("cost_source"), "local_stages": self.pipe.runner.local_stages,
            "cut_record": self.pipe.compiled.cut_record,
        }


class TorchPipeline(Pipeline):
    """torch.distributed.pipelining's schedule `name` over chunks of even blocks (two per rank for
    its multi-chunk schedules), on `rank_device(settings.device)`."""

    def __init__(self, name: str, m: int, settings: Any, tokens, targets) -> None:
        from torch.distributed import pipelining

        from zbcompile.models.gpt import lm_loss

        ranks, rank = dist.get_world_size(), dist.get_rank()
        chunks = 2 * ranks if name in MULTI_CHUNK else ranks
        if settings.layers % chunks:
            raise ValueError(f"{settings.layers} layers do not split into {chunks} chunks")
        per = settings.layers // chunks
        owner = chunk_ranks(name, chunks, ranks)
        device = rank_device(settings.device)
        gpt = model(settings).to(getattr(torch, settings.dtype))
        chunk = chunk_class(settings)
        mine = [c for c in range(chunks) if owner[c] == rank]
        self.modules = [chunk(gpt, c * per, (c + 1) * per, c == 0, c == chunks - 1).to(device) for c in mine]
        stages = [pipelining.PipelineStage(module, c, chunks, device) for module, c in zip(self.modules, mine)]
        schedule = getattr(pipelining, name)
        self.schedule = schedule(stages[0] if name not in MULTI_CHUNK else stages, m, loss_fn=lm_loss)
        self.has_first, self.has_last = 0 in mine, chunks - 1 in mine
        super().__init__([p for module in self.modules for p in module.parameters()], settings, tokens, targets)

    def step(self) -> None:
        torch_step(self.schedule, self.tokens, self.targets, self.has_first, self.has_last)


def share_compilation() -> None:
    """Compile each microbatch shape once per rank and share the result between the schedules
    of that shape: the compiled stage graphs do not depend on the schedule (nor on the model
    instance: the runtime looks parameters up by name), so this changes only the set-up time."""
    from zbcompile.runtime import build

    original = build.compile_pipeline
    cache: dict = {}

    def compile_once(model, loss_fn, args, kwargs, target, stages, split_points=None, device=None, **options):
        key = (
            tuple((tuple(a.shape), a.dtype) for a in args), tuple(target.shape), stages,
            tuple(split_points or ()), str(device), tuple(sorted(options.items())),
        )
        if key not in cache:
            cache[key] = original(model, loss_fn, args, kwargs, target, stages, split_points, device, **options)
        return cache[key]

    build.compile_pipeline = compile_once


# --- reading the rounds -------------------------------------------------------------------------


def others_cores(usages: Sequence[Sequence[measure.Usage]]) -> list[float]:
    """Per round: cores' worth of CPU that other jobs used meanwhile (the machine's busy time, which
    rank 0 reads, minus every rank's own CPU time, over the wall time); `usages[rank][round]`."""
    return [
        measure.others_cores(round_[0].wall_s, round_[0].machine_busy_s, [u.own_cpu_s for u in round_])
        for round_ in zip(*usages)
    ]


def quietest(others: Sequence[float], share: float) -> list[int]:
    """The rounds, in order, of the `share` of them (at least one) in which others used the least CPU."""
    keep = max(1, math.ceil(share * len(others)))
    return sorted(sorted(range(len(others)), key=lambda i: others[i])[:keep])


def stage_costs(medians: dict, stages: int, comm: float):
    """Costs per stage from one statistic of each (stage, action kind): I and W where the schedule
    split the backward, else the fused B as I with W = 0 (a fused B costs I + W either way)."""
    from zbcompile.schedules import Costs

    f, i, w = [], [], []
    for s in range(stages):
        f.append(medians.get((s, "F"), 0.0))
        split = (s, "I") in medians
        i.append(medians[(s, "I")] if split else medians.get((s, "B"), 0.0))
        w.append(medians.get((s, "W"), 0.0) if split else 0.0)
    return Costs(f=f, i=i, w=w, comm=comm)


def costs_ms(costs: Any) -> dict[str, Any]:
    """`costs` in milliseconds: per stage F, I (a fused B where the backward is not split) and W, and a message."""
    ms = {key: [1e3 * x for x in getattr(costs, name)] for key, name in (("f_ms", "f"), ("b_ms", "i"), ("w_ms", "w"))}
    return {**ms, "comm_ms": 1e3 * costs.comm}


def _timeline_stats(steps: Sequence[Sequence[dict]]) -> tuple[dict, list[float], list[float], int, dict]:
    """From `steps` (per settled step, each rank's recorded sample): each (stage, kind)'s compute
    times (the time an action waited for a message taken out), the message latencies that could be
    observed, per step the largest per-rank sum of gaps between consecutive actions that were not
    waits (the runtime's own work between actions: posting sends and receives, bookkeeping), the
    actions per rank and step, and per rank its compute times summed in each step."""
    from zbcompile.schedules import Action

    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    busy: dict[int, list[float]] = defaultdict(list)
    latencies: list[float] = []
    gaps: list[float] = []
    actions = 0
    for samples in steps:
        end_of: dict[tuple[int, str, int], float] = {}
        wait_of: dict[str, tuple[float, float]] = {}
        step_gaps = []
        for rank, sample in enumerate(samples):
            rank_waits = {a: (s, e) for a, s, e in sample["waits"]}
            previous_end = None
            gap = 0.0
            busy[rank].append(0.0)
            timeline = sorted(sample["timeline"], key=lambda e: e[1])
            actions = max(actions, len(timeline))
            for text, start, end in timeline:
                action = Action.parse(text)
                waited = rank_waits.get(text)
                # runtimes that start an action's clock before its wait count the wait in: take it out
                overlap = max(0.0, min(end, waited[1]) - max(start, waited[0])) if waited else 0.0
                took = (end - start) - overlap
                durations[(action.stage, action.kind)].append(took)
                busy[rank][-1] += took
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
            stage, kind = (action.stage - 1, "F") if action.kind == "F" else (action.stage + 1, "I")
            producer = (stage, kind, action.microbatch)
            if producer in end_of and start <= end_of[producer]:
                latencies.append(max(0.0, end - end_of[producer]))
    return durations, latencies, gaps, actions, busy


def predict(schedule: Any, steps: Sequence[Sequence[dict]]) -> dict:
    """The simulator's makespan and span for `schedule`, the schedule that ran, under the per-action
    medians of `steps` (see `_timeline_stats`), and 1F1B simulated under the same costs: the most
    this schedule could gain over it between barriers (makespans) and back to back (spans, the
    steady-state gain)."""
    from zbcompile.schedules import make_schedule, simulate
    from zbcompile.schedules.costs import resolve_costs

    durations, latencies, gaps, actions, busy = _timeline_stats(steps)
    comm = _launch.median(latencies) if latencies else 0.0
    costs = stage_costs({k: _launch.median(v) for k, v in durations.items()}, schedule.stages, comm)
    sim = simulate(schedule, costs)
    # 1F1B on the same ranks: a V's chunks 2r and 2r+1 make rank r's stage
    in_line = resolve_costs(costs, schedule.stages).merged(schedule.stages // schedule.ranks)
    one_f_one_b = simulate(make_schedule("1f1b", schedule.ranks, schedule.microbatches, check=False), in_line)
    return {
        **costs_ms(costs), "makespan_ms": 1e3 * sim.makespan, "span_ms": 1e3 * sim.span,
        # each rank's actions summed in a step (the first microbatch's W included, slower every step than
        # the others for its new gradient buffers, which per-action medians would leave out), median over steps
        "busy_ms": [1e3 * _launch.median(busy[r]) for r in sorted(busy)],
        "simulated_gain_over_1f1b": one_f_one_b.makespan / sim.makespan,
        "simulated_steady_gain_over_1f1b": one_f_one_b.span / sim.span,
        "runtime_gaps_ms": 1e3 * _launch.median(gaps),
        "runtime_gap_per_action_us": 1e6 * _launch.median(gaps) / max(actions, 1),
    }
