"""Training-step throughput on CPU: zbcompile's 1f1b, zb-h1, zb-h2 and zb-auto beside
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble and ScheduleDualPipeV, on the same GPT, 2 gloo ranks with one thread each,
m in {4, 8} microbatches, all in one run.

Every (library, schedule, m) pipeline is built up front in both ranks; then rounds alternate
between them (the order reverses every other round), so that the machine's changing load falls on
all of them alike. Per round and pipeline: one step between two barriers (`barrier; step;
barrier`, the optimizer outside: the step's makespan), then a few steps back to back with the
optimizer step in between, as a training loop runs them (no barrier between steps: steps/s, the
steady-state rate once the first steps have settled).
Warm-up steps are not timed. Each round also records how much CPU other jobs took meanwhile
(machine busy time from /proc/stat minus both ranks' own CPU time): on a shared machine the medians
use each pipeline's quietest half of its rounds (all-round medians are reported beside them).
Reported: steps/s, the ratio to torch's best schedule and to zbcompile's 1f1b at the same m, for
both measures.

For zbcompile's pipelines the runner's per-action timeline (minus the time each action waited
for a message) gives per-stage medians of F, I, W (or fused B) and the message latency; the
simulator then predicts the step's makespan for the schedule that ran, printed beside the
measured step time.

    python benchmarks/runtime_cpu.py            # ~6 minutes on 2 cores
    python benchmarks/runtime_cpu.py --quick    # a smoke run

Writes benchmarks/results/runtime_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))

import _launch  # noqa: E402

ZB_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-auto")
TORCH_SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
MULTI_STAGE = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
# zb-auto re-solved with costs measured during its first steps, where the library offers it
PROFILED = "zb-auto(profiled)"
PROFILE_STEPS = 2  # the library's default number of profiled steps


def _has_profile_option() -> bool:
    import inspect

    import zbcompile

    return "profile" in inspect.signature(zbcompile.pipeline).parameters


@dataclass(frozen=True)
class Settings:
    vocab: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    rows: int = 3  # rows (sequences) per microbatch: a step of m=4 takes over 0.1 s
    microbatches: tuple[int, ...] = (4, 8)
    warmup: int = 2
    rounds: int = 12
    steps_per_round: int = 6  # back-to-back steps per round (after one step between barriers)
    settle_steps: int = 2  # of those, the first ones the steady-state period leaves out
    lr: float = 1e-3
    timeout_s: float = 300.0
    zb_schedules: tuple[str, ...] = ZB_SCHEDULES
    torch_schedules: tuple[str, ...] = TORCH_SCHEDULES
    profiled: bool = True  # also run zb-auto re-solved with measured costs, if the library can
    quiet_share: float = 0.5  # medians over this share of each pipeline's rounds, the quietest ones


# --- the model, cut by hand for torch.distributed.pipelining ---------------------------------


def _gpt(settings: Settings):
    import torch

    from zbcompile.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=settings.vocab,
        seq_len=settings.seq_len,
        hidden=settings.hidden,
        heads=settings.heads,
        layers=settings.layers,
        tie_embeddings=False,
    )
    return GPT(config)


def _chunk_class():
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


def _torch_stage_ranks(name: str, chunks: int, ranks: int) -> list[int]:
    """Rank of each chunk: one per rank; a loop for interleaved; a V for ZBV and DualPipeV."""
    if name not in MULTI_STAGE:
        return list(range(ranks))
    if name in V_SHAPED:
        return [s if s < ranks else chunks - 1 - s for s in range(chunks)]
    return [s % ranks for s in range(chunks)]


# --- one pipeline of either library, as a rank sees it ----------------------------------------


class ZbPipeline:
    def __init__(self, schedule: str, m: int, settings: Settings, tokens, targets) -> None:
        import torch

        import zbcompile
        from zbcompile.models.gpt import lm_loss

        self.model = _gpt(settings)
        split = [f"blocks.{settings.layers // 2}"]
        extra = {"profile": True} if schedule == PROFILED else {}
        self.warmup = settings.warmup + (PROFILE_STEPS if schedule == PROFILED else 0)
        self.pipe = zbcompile.pipeline(
            self.model,
            stages=2,
            microbatches=m,
            loss_fn=lm_loss,
            schedule="zb-auto" if schedule == PROFILED else schedule,
            split_points=split,
            timeout=settings.timeout_s,
            **extra,
        )
        self.pipe.compile(tokens, target=targets)
        self.optimizer = torch.optim.SGD(self.pipe.parameters(), lr=settings.lr)
        self.tokens, self.targets = tokens, targets
        self.samples: list[dict] = []  # per timed step: timeline and waits
        self._waits: list[tuple[str, float, float]] = []
        transport = self.pipe.runner.transport
        original = transport.wait

        def timed_wait(pending, waiting_action):
            started = time.perf_counter()
            result = original(pending, waiting_action)
            self._waits.append((waiting_action, started, time.perf_counter()))
            return result

        transport.wait = timed_wait

    def step(self) -> None:
        self._waits = []
        self.pipe.step(self.tokens, target=self.targets)

    def record(self) -> None:
        self.samples.append({"timeline": list(self.pipe.runner.timeline), "waits": list(self._waits)})

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
        chunks = 2 * ranks if name in MULTI_STAGE else ranks
        if settings.layers % chunks:
            raise ValueError(f"{settings.layers} layers do not split into {chunks} chunks")
        per = settings.layers // chunks
        owner = _torch_stage_ranks(name, chunks, ranks)
        gpt = _gpt(settings)
        Chunk = _chunk_class()
        self.modules = [
            Chunk(gpt, c * per, (c + 1) * per, c == 0, c == chunks - 1) for c in range(chunks) if owner[c] == rank
        ]
        mine = [c for c in range(chunks) if owner[c] == rank]
        stages = [
            pipelining.PipelineStage(module, c, chunks, torch.device("cpu")) for module, c in zip(self.modules, mine)
        ]
        cls = getattr(pipelining, name)
        self.schedule = cls(stages[0] if name not in MULTI_STAGE else stages, m, loss_fn=lm_loss)
        self.has_first, self.has_last = 0 in mine, chunks - 1 in mine
        self.warmup = settings.warmup
        params = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=settings.lr)
        self.tokens, self.targets = tokens, targets

    def step(self) -> None:
        args = (self.tokens,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=self.targets, losses=[], return_outputs=False)
        else:
            self.schedule.step(*args, return_outputs=False)

    def record(self) -> None:
        pass

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def rank_main(settings: Settings) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pipelines: dict[tuple[str, str, int], object] = {}
    build_s: dict[str, float] = {}
    _share_compilation()
    zb_schedules = list(settings.zb_schedules)
    if settings.profiled and _has_profile_option():
        zb_schedules.append(PROFILED)
    for m in settings.microbatches:
        generator = torch.Generator().manual_seed(m)
        tokens = torch.randint(0, settings.vocab, (m * settings.rows, settings.seq_len), generator=generator)
        targets = tokens.roll(-1, 1)
        for name in zb_schedules:
            started = time.perf_counter()
            pipelines[("zbcompile", name, m)] = ZbPipeline(name, m, settings, tokens, targets)
            build_s[f"zbcompile {name} m={m}"] = time.perf_counter() - started
        for name in settings.torch_schedules:
            started = time.perf_counter()
            pipelines[("torch", name, m)] = TorchPipeline(name, m, settings, tokens, targets)
            build_s[f"torch {name} m={m}"] = time.perf_counter() - started
    if rank == 0:
        print(f"built {len(pipelines)} pipelines in {sum(build_s.values()):.0f} s", flush=True)

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
        that lined the ranks up: a step that follows another overlaps its start with the
        previous step's tail, as every step but the first of a training run does)."""
        dist.barrier()
        ends = [time.perf_counter()]
        for _ in range(steps):
            pipeline.step()
            pipeline.optimize()
            ends.append(time.perf_counter())
        dist.barrier()
        settle = min(settings.settle_steps, steps - 1)
        return (ends[-1] - ends[settle]) / (steps - settle)

    keys = list(pipelines)
    for key in keys:  # warm-up (torch infers shapes on its first step)
        for _ in range(pipelines[key].warmup):
            barrier_step(pipelines[key])
    times: dict[tuple, list[float]] = defaultdict(list)
    barrier_times: dict[tuple, list[float]] = defaultdict(list)
    # per measurement: wall seconds, this rank's CPU seconds (all its threads), and on rank 0 the
    # whole machine's busy CPU seconds, to tell how much of the cores other jobs took meanwhile
    usage: dict[tuple, list[tuple[float, float, float]]] = defaultdict(list)
    loads = [_launch.machine()["loadavg_1_5_15"][0]]
    for r in range(settings.rounds):
        for key in keys if r % 2 == 0 else reversed(keys):
            dist.barrier()
            wall, own, busy = time.perf_counter(), time.process_time(), _launch.cpu_busy_seconds()
            barrier_times[key].append(barrier_step(pipelines[key]))
            pipelines[key].record()
            times[key].append(back_to_back(pipelines[key], settings.steps_per_round))
            usage[key].append((time.perf_counter() - wall, time.process_time() - own, _launch.cpu_busy_seconds() - busy))
        loads.append(_launch.machine()["loadavg_1_5_15"][0])
        if rank == 0:
            print(f"round {r + 1}/{settings.rounds} done, load {loads[-1]:.2f}", flush=True)
    result = {"times": dict(times), "barrier_times": dict(barrier_times), "usage": dict(usage), "loads": loads, "build_s": build_s, "zb": {}}
    for key, pipeline in pipelines.items():
        if isinstance(pipeline, ZbPipeline):
            schedule = pipeline.pipe.schedule
            result["zb"][key] = {
                "samples": pipeline.samples,
                "schedule": schedule,
                "local_stages": pipeline.pipe.runner.local_stages,
                "solve_s": schedule.info.get("solve_time_s"),
            }
    return result


def _share_compilation() -> None:
    """Compile each microbatch shape once per rank and share the result between the schedules
    of that shape: the compiled stage graphs do not depend on the schedule (nor on the model
    instance: the runtime looks parameters up by name), so this changes only the set-up time."""
    import zbcompile.api as api

    original = api.compile_pipeline
    cache: dict = {}

    def compile_once(model, loss_fn, args, kwargs, target, stages, split_points=None, device=None):
        key = (
            tuple((tuple(a.shape), a.dtype) for a in args),
            tuple(target.shape),
            stages,
            tuple(split_points or ()),
            str(device),
        )
        if key not in cache:
            cache[key] = original(model, loss_fn, args, kwargs, target, stages, split_points, device)
        return cache[key]

    api.compile_pipeline = compile_once


# --- analysis ---------------------------------------------------------------------------------


def _durations(per_rank: list[dict], key, rounds: list[int]) -> tuple[dict, list[float], list[float]]:
    """From every timed step's timelines: each (stage, kind)'s compute times (the time an action
    waited for a message taken out), the message latencies that could be observed, and per step
    the largest per-rank sum of gaps between consecutive actions that were not waits (the
    runtime's own work between actions: posting sends and receives, bookkeeping)."""
    from zbcompile.schedules import Action

    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    latencies: list[float] = []
    gaps: list[float] = []
    for step in rounds:
        end_of: dict[tuple[int, str, int], float] = {}
        wait_of: dict[str, tuple[float, float]] = {}
        step_gaps = []
        for rank_result in per_rank:
            sample = rank_result["zb"][key]["samples"][step]
            rank_waits = {a: (s, e) for a, s, e in sample["waits"]}
            previous_end = None
            gap = 0.0
            for text, start, end in sample["timeline"]:
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
        # latency of a message: from its producer's end to the end of a wait that blocked on it
        for text, (start, end) in wait_of.items():
            if end - start < 2e-4:  # arrived before it was needed: latency not observable
                continue
            action = Action.parse(text)
            producer = (action.stage - 1, "F", action.microbatch) if action.kind == "F" else (action.stage + 1, "I", action.microbatch)
            if producer in end_of:
                latencies.append(max(0.0, end - end_of[producer]))
    return durations, latencies, gaps


def _action_window(per_rank: list[dict], key, rounds: list[int]) -> float:
    """Median over timed steps of first action start to last action end, over both ranks."""
    windows = []
    for step in rounds:
        spans = [(s, e) for r in per_rank for _, s, e in r["zb"][key]["samples"][step]["timeline"]]
        windows.append(max(e for _, e in spans) - min(s for s, _ in spans))
    return _launch.median(windows)


def _costs(stat: dict, stages: int, comm: float):
    """Costs per stage from one statistic of each action kind: I and W where the schedule split
    the backward, else the fused B as b with w = 0 (a fused B costs b + w either way)."""
    from zbcompile.schedules import Costs

    f, b, w = [], [], []
    for s in range(stages):
        f.append(stat.get((s, "F"), 0.0))
        if (s, "I") in stat:
            b.append(stat[(s, "I")])
            w.append(stat.get((s, "W"), 0.0))
        else:
            b.append(stat.get((s, "B"), 0.0))
            w.append(0.0)
    return Costs(f=f, b=b, w=w, comm=comm)


def predict(per_rank: list[dict], key, rounds: list[int]) -> dict:
    """The simulator's makespan for the schedule that ran, from the measured per-action medians
    (and, beside it, from their means, which count the slow outliers a loaded machine causes);
    and 1F1B simulated under the same costs, the most this schedule could gain over it."""
    import statistics

    from zbcompile.schedules import make_schedule, simulate

    schedule = per_rank[0]["zb"][key]["schedule"]
    durations, latencies, gaps = _durations(per_rank, key, rounds)
    comm = _launch.median(latencies) if latencies else 0.0
    medians = {k: _launch.median(v) for k, v in durations.items()}
    means = {k: statistics.fmean(v) for k, v in durations.items()}
    costs = _costs(medians, schedule.stages, comm)
    sim = simulate(schedule, costs)
    sim_means = simulate(schedule, _costs(means, schedule.stages, comm))
    one_f_one_b = simulate(make_schedule("1f1b", schedule.stages, schedule.microbatches, check=False), costs)
    return {
        "f_ms": [1e3 * x for x in costs.f],
        "b_ms": [1e3 * x for x in costs.b],
        "w_ms": [1e3 * x for x in costs.w],
        "comm_ms": 1e3 * comm,
        "comm_observations": len(latencies),
        "makespan_ms": 1e3 * sim.makespan,
        "makespan_from_means_ms": 1e3 * sim_means.makespan,
        "span_ms": 1e3 * sim.span,
        "bubble_rate": sim.bubble_rate,
        "one_f_one_b_makespan_ms": 1e3 * one_f_one_b.makespan,
        "simulated_gain_over_1f1b": one_f_one_b.makespan / sim.makespan,
        "simulated_steady_gain_over_1f1b": one_f_one_b.span / sim.span,
        "action_window_ms": 1e3 * _action_window(per_rank, key, rounds),
        "runtime_gaps_ms": 1e3 * _launch.median(gaps),
    }


def others_cores(per_rank: list[dict], key) -> list[float]:
    """Per round: cores' worth of CPU that other jobs used while this pipeline was measured
    (machine busy time minus both ranks' own CPU time, over the wall time)."""
    result = []
    for i, (wall, own0, busy) in enumerate(per_rank[0]["usage"][key]):
        own = own0 + sum(r["usage"][key][i][1] for r in per_rank[1:])
        result.append(max(0.0, (busy - own) / wall) if wall > 0 else float("nan"))
    return result


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
            f"medians over the quietest {settings.quiet_share:.0%} of each pipeline's rounds (those in which "
            "other jobs used the least CPU); the all-rounds medians are in the last two columns"
        )
    return times, barrier, chosen, note


def analyse(per_rank: list[dict], settings: Settings, machine_before: dict, machine_after: dict, wall_s: float) -> dict:
    times, barrier_times, chosen, selection = _select(per_rank, settings)
    all_times, all_barrier = per_rank[0]["times"], per_rank[0]["barrier_times"]
    rows = []
    for m in settings.microbatches:
        keys = [k for k in times if k[2] == m]
        loop = {k: _launch.median(times[k]) for k in keys}
        barrier = {k: _launch.median(barrier_times[k]) for k in keys}
        torch_keys = [k for k in keys if k[0] == "torch"]
        best = min(torch_keys, key=loop.get)
        best_barrier = min(torch_keys, key=barrier.get)
        one_f_one_b = ("zbcompile", "1f1b", m)
        all_rounds = per_rank[0]["times"]

        def paired(reference, key) -> float:
            """Median over rounds of reference's step time over key's in the same round (the
            machine's speed drifts; within one round both ran under the same conditions)."""
            return _launch.median([a / b for a, b in zip(all_rounds[reference], all_rounds[key])])

        for key in keys:
            lib, name, _ = key
            row = {
                "library": lib,
                "schedule": name,
                "m": m,
                "step_ms": 1e3 * loop[key],
                "steps_per_s": 1.0 / loop[key],
                "vs_torch_best": loop[best] / loop[key],
                "vs_zbcompile_1f1b": loop[one_f_one_b] / loop[key],
                "torch_best": best[1],
                "paired_vs_torch_best": paired(best, key),
                "paired_vs_zbcompile_1f1b": paired(one_f_one_b, key),
                "rounds_used": chosen[key],
                "others_cores": others_cores(per_rank, key),
                "step_ms_all_rounds": 1e3 * _launch.median(all_times[key]),
                "barrier_step_ms_all_rounds": 1e3 * _launch.median(all_barrier[key]),
                "step_ms_samples": [1e3 * t for t in all_times[key]],
                "barrier_step_ms": 1e3 * barrier[key],
                "barrier_vs_torch_best": barrier[best_barrier] / barrier[key],
                "barrier_vs_zbcompile_1f1b": barrier[one_f_one_b] / barrier[key],
                "barrier_torch_best": best_barrier[1],
                "barrier_step_ms_samples": [1e3 * t for t in all_barrier[key]],
            }
            if lib == "zbcompile":
                row["prediction"] = predict(per_rank, key, chosen[key])
                row["barrier_over_makespan"] = row["barrier_step_ms"] / row["prediction"]["makespan_ms"]
                row["loop_over_span"] = row["step_ms"] / row["prediction"]["span_ms"]
                row["solve_s"] = per_rank[0]["zb"][key]["solve_s"]
                row["schedule_actions"] = [" ".join(str(a) for a in r) for r in per_rank[0]["zb"][key]["schedule"].compute_only().actions]
            rows.append(row)
    targets = []
    for m in settings.microbatches:
        auto = next(r for r in rows if r["library"] == "zbcompile" and r["schedule"] == "zb-auto" and r["m"] == m)
        for label, value in (
            ("zb-auto steps/s >= 1.10x torch's best", auto["vs_torch_best"]),
            ("zb-auto steps/s >= 1.10x zbcompile 1f1b", auto["vs_zbcompile_1f1b"]),
            ("(paired per round) zb-auto steps/s >= 1.10x torch's best", auto["paired_vs_torch_best"]),
            ("(paired per round) zb-auto steps/s >= 1.10x zbcompile 1f1b", auto["paired_vs_zbcompile_1f1b"]),
            ("(barrier per step) zb-auto >= 1.10x torch's best", auto["barrier_vs_torch_best"]),
            ("(barrier per step) zb-auto >= 1.10x zbcompile 1f1b", auto["barrier_vs_zbcompile_1f1b"]),
        ):
            targets.append({"m": m, "target": label, "value": value, "holds": value >= 1.10})
    for r in rows:
        if r["library"] == "zbcompile":
            ratio = r["barrier_over_makespan"]
            targets.append({
                "m": r["m"],
                "target": f"{r['schedule']}: step (barrier) within 15% of the simulated makespan",
                "value": ratio,
                "holds": abs(ratio - 1.0) <= 0.15,
            })
    return {
        "settings": asdict(settings),
        "selection": selection,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "load_during_rounds": per_rank[0]["loads"],
        "wall_s": wall_s,
        "build_s": per_rank[0]["build_s"],
        "rows": rows,
        "targets": targets,
    }


def report(data: dict) -> str:
    s = data["settings"]
    rows = data["rows"]
    lines = [
        "# Training-step throughput on CPU: zbcompile beside torch.distributed.pipelining",
        "",
        f"GPT (untied embeddings) vocab {s['vocab']}, seq {s['seq_len']}, hidden {s['hidden']}, heads {s['heads']}, "
        f"{s['layers']} layers; {s['rows']} rows per microbatch; 2 gloo ranks, 1 thread each. zbcompile: 2 stages "
        f"split at blocks.{s['layers'] // 2}; torch: the same split for GPipe/1F1B, 4 chunks of "
        f"{s['layers'] // 4} block(s) for the 2-chunks-per-rank schedules. zb-auto(profiled): zb-auto re-solved "
        "with the costs its first steps measured (`pipeline(..., profile=True)`).",
        f"{s['warmup']} warm-up steps per pipeline (untimed), then {s['rounds']} rounds alternating over all "
        f"pipelines (order reversed every other round); per round and pipeline: one step between two barriers "
        f"(its makespan), then {s['steps_per_round']} steps back to back with the optimizer step, as a training "
        f"loop runs them (steps/s: the steady-state rate, from the end of step {s['settle_steps']} to the end of the "
        "last, where each step's start overlaps the previous step's tail). Before and after each pipeline's measurement the machine's busy CPU time is "
        "read, so that each round knows how much CPU other jobs took meanwhile.",
        f"Machine: {_launch.load_line(data['machine_before'])} before, "
        f"{_launch.load_line(data['machine_after'])} after; 1-min load during the rounds "
        f"{min(data['load_during_rounds']):.1f} to {max(data['load_during_rounds']):.1f} (other jobs shared the 2 cores). "
        f"Run took {data['wall_s']:.0f} s.",
        "",
        "## Steps per second",
        "",
        f"Other jobs' CPU use during each pipeline's rounds (cores, median over all pipelines and rounds): "
        f"{_launch.median([c for r in rows for c in r['others_cores']]):.2f}; {data['selection']}. Paired: the "
        "median over all rounds of the two pipelines' step-time ratio within each round (the machine's speed "
        "drifts between rounds; the torch best is the one by medians).",
        "",
    ]
    lines.append(_launch.table(
        ["schedule", "m", "steps/s", "ms/step", "vs torch best", "vs zbcompile 1f1b", "paired: vs torch best",
         "paired: vs zbcompile 1f1b", "barrier step ms",
         "barrier: vs torch best", "barrier: vs zbcompile 1f1b", "rounds used", "ms/step, all rounds",
         "barrier ms, all rounds"],
        [
            [f"{r['library']} {r['schedule']}", r["m"], f"{r['steps_per_s']:.2f}", f"{r['step_ms']:.1f}",
             f"{r['vs_torch_best']:.2f}x", f"{r['vs_zbcompile_1f1b']:.2f}x", f"{r['paired_vs_torch_best']:.2f}x",
             f"{r['paired_vs_zbcompile_1f1b']:.2f}x", f"{r['barrier_step_ms']:.1f}",
             f"{r['barrier_vs_torch_best']:.2f}x", f"{r['barrier_vs_zbcompile_1f1b']:.2f}x", len(r["rounds_used"]),
             f"{r['step_ms_all_rounds']:.1f}", f"{r['barrier_step_ms_all_rounds']:.1f}"]
            for r in rows
        ],
    ))
    bests = sorted({(r["m"], r["torch_best"], r["barrier_torch_best"]) for r in rows})
    lines += ["", "torch best (steps/s; barrier): " + ", ".join(f"m={m}: {a}; {b}" for m, a, b in bests), ""]
    lines += ["## Measured vs the simulator (per-action medians from the runtime's timeline)", ""]
    lines.append(_launch.table(
        ["schedule", "m", "F ms (s0/s1)", "I or B ms", "W ms", "comm ms", "barrier step ms", "simulated makespan ms",
         "barrier / makespan", "actions window ms", "runtime gaps ms", "makespan from means ms", "ms/step",
         "simulated span ms", "simulated gain over 1f1b", "simulated steady-state gain over 1f1b"],
        [
            [r["schedule"], r["m"],
             "/".join(f"{x:.1f}" for x in r["prediction"]["f_ms"]),
             "/".join(f"{x:.1f}" for x in r["prediction"]["b_ms"]),
             "/".join(f"{x:.1f}" for x in r["prediction"]["w_ms"]),
             f"{r['prediction']['comm_ms']:.2f}",
             f"{r['barrier_step_ms']:.1f}", f"{r['prediction']['makespan_ms']:.1f}", f"{r['barrier_over_makespan']:.3f}",
             f"{r['prediction']['action_window_ms']:.1f}", f"{r['prediction']['runtime_gaps_ms']:.1f}",
             f"{r['prediction']['makespan_from_means_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['prediction']['span_ms']:.1f}",
             f"{r['prediction']['simulated_gain_over_1f1b']:.3f}x",
             f"{r['prediction']['simulated_steady_gain_over_1f1b']:.3f}x"]
            for r in rows if r["library"] == "zbcompile"
        ],
    ))
    lines += [
        "",
        "I or B: the input-gradient backward I where the schedule splits it, else the fused backward B with W = 0 "
        "(stage 0's I is empty: its whole backward is W). Per-action times exclude waiting for a message; comm: median "
        "delay from a producer's end to the end of a receiver's wait that blocked on it. Simulated makespan: the "
        "simulator on the per-stage medians (the target's measure, against the step between barriers); makespan "
        "from means: the same on the means, which count a loaded machine's slow outliers. Actions window: first "
        "action's start to last action's end over both ranks (the rest of a barrier step is work outside the "
        "actions: splitting the batch, gradient hand-over, barriers). Runtime gaps: per step, the larger per-rank sum "
        "of the time between consecutive actions that was not a wait for a message (posting sends and receives, "
        "bookkeeping); the simulator has no such time. Simulated span: the longest per-rank span, the step time "
        "back-to-back steps approach (zb-auto minimises it). Simulated gain over 1f1b: 1F1B's simulated makespan over "
        "this schedule's, both under this row's costs: the most the schedule can gain at this p and m between "
        "barriers; steady-state gain: the same for the spans, the most it can gain in steps/s.",
        "",
        "## Targets",
        "",
    ]
    lines.append(_launch.table(
        ["m", "target", "measured", "holds"],
        [[t["m"], t["target"], f"{t['value']:.3f}", "yes" if t["holds"] else "NO"] for t in data["targets"]],
    ))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--steps-per-round", type=int, default=Settings.steps_per_round)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--quick", action="store_true", help="a smoke run: m=4 only, 1 round, smaller model")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results files alone")
    options = parser.parse_args()
    settings = Settings(rounds=options.rounds, steps_per_round=options.steps_per_round, warmup=options.warmup)
    if options.quick:
        settings = Settings(hidden=32, seq_len=16, layers=4, microbatches=(4,), rounds=1, steps_per_round=1, warmup=1)
    _launch.run_and_report("runtime_cpu", 2, rank_main, settings, analyse, report, write=not options.no_write and not options.quick)


if __name__ == "__main__":
    main()
