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
how its schedule race went (`runtime/tuning/contest.py`).

Targets, for both models and every m ("never behind", `NEVER_BEHIND`): zb-auto at least 1.00x
torch's best and 0.98x our best fixed schedule (1f1b, zb-h1, zb-h2, zbv), its step within 5% of
its busy-time bound (the slowest rank's actions summed in a step, median over steps); our 1f1b at least 0.98x torch's.

    python benchmarks/runtime_cpu.py                 # ~6 minutes on 2 quiet cores
    python benchmarks/runtime_cpu.py --model llama   # the Llama-style decoder
    python benchmarks/runtime_cpu.py --model tiny-llama   # the same at d=96, seq 32, m=16: host time shows
    python benchmarks/runtime_cpu.py --quick         # a smoke run (with --model llama: the decoder, small)

Writes benchmarks/results/runtime_cpu.{json,md} (runtime_cpu_MODEL.{json,md} for the others).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import _launch
import _pairing
from zbcompile import measure
from zbcompile.inspect.decisions_text import race_lines

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


@dataclass(frozen=True)
class Settings(_launch.Settings):
    rows: int = 3  # rows (sequences) per microbatch, unless sized from a measured step
    step_target_s: float | None = 0.1  # size `rows` so that a 1f1b step at the smallest m takes about this
    microbatches: tuple[int, ...] = (4, 8, 16)
    warmup: int = 2
    steps_per_round: int = 5  # back-to-back steps per round (after one step between barriers)
    settle_steps: int = 2  # of those, the first ones the steady-state period leaves out
    lr: float = 1e-3
    zb_schedules: tuple[str, ...] = ZB_SCHEDULES
    torch_schedules: tuple[str, ...] = TORCH_SCHEDULES
    quiet_share: float = 0.5  # medians over this share of each pipeline's rounds, the quietest ones
    model: str = "gpt"  # "gpt": the zoo GPT; "llama", "tiny-llama": benchmarks/llama_style.py (`SHAPES`)
    device: str = "cpu"  # where each rank computes: "cpu", or "cuda" (cuda:LOCAL_RANK, benchmarks/gpu_pipelines.py)
    dtype: str = "float32"  # the model's parameters and activations


MODEL_NAMES = {
    "gpt": "GPT (untied embeddings)",
    "llama": "Llama-style (RMSNorm, rotary, SwiGLU, untied head)",
    "tiny-llama": "Llama-style, tiny (actions of a few ms: the runtimes' own time per action shows)",
}
# zb-auto never behind: against torch's best, against our best fixed schedule (`FIXED`), and its
# step against its busy-time bound (the slowest rank's actions summed in a step, median over steps);
# our 1F1B against torch's
NEVER_BEHIND = {"torch": 1.00, "ours": 0.98, "bound": 1.05, "1f1b": 0.98}
LLAMA = dict(vocab=512, seq_len=128, hidden=256, heads=4, layers=8, microbatches=(4, 8))  # the held-out shape
SHAPES = {  # per model other than the GPT: its shape, microbatches, and rows per microbatch (None: sized)
    "llama": (LLAMA, None),
    "tiny-llama": (dict(vocab=512, seq_len=32, hidden=96, heads=4, layers=8, microbatches=(16,)), 1),
}


def _pipeline(library: str, name: str, m: int, settings: Settings, tokens, targets) -> _pairing.Pipeline:
    """torch's schedule `name`, or zbcompile's pipeline `name` (a schedule, or one of `VARIANTS`)."""
    if library == "torch":
        return _pairing.TorchPipeline(name, m, settings, tokens, targets)
    schedule, options = VARIANTS.get(name, (name, {}))
    return _pairing.ZbPipeline(schedule, m, settings, tokens, targets, **options)


def _calibrated_rows(settings: Settings) -> tuple[int, float]:
    """Rows per microbatch for which zbcompile's 1f1b step at the smallest m takes about
    `step_target_s` on this machine now: a first guess from the GPT's eager forward + backward,
    then a few steps of that pipeline, timed, scale it (rank 0's choice, shared). Also the
    measured step time of the guess."""
    import torch.distributed as dist

    from zbcompile.models.gpt import lm_loss

    model = _pairing.model(settings)
    tokens, targets = _launch.batch(replace(settings, rows=8), 1, seed=0)
    samples = []
    for _ in range(4):
        started = time.perf_counter()
        lm_loss(model(tokens), targets).backward()
        samples.append(time.perf_counter() - started)
    m = min(settings.microbatches)
    # p=2: (m + 1) forward-backward slots of one stage (half the model) per 1F1B step
    box = [max(1, round(2 * settings.step_target_s / ((m + 1) * statistics.median(samples[1:]) / 8)))]
    dist.broadcast_object_list(box, src=0)
    guess = replace(settings, rows=box[0])
    pipeline = _pairing.ZbPipeline("1f1b", m, guess, *_launch.batch(guess, m, seed=0))
    steps = []
    for _ in range(5):
        dist.barrier()
        started = time.perf_counter()
        pipeline.step()
        pipeline.optimize()
        steps.append(time.perf_counter() - started)
    measured = statistics.median(steps[1:])
    box = [(max(1, round(guess.rows * settings.step_target_s / measured)), measured)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_main(settings: Settings) -> dict:
    import torch.distributed as dist

    calibration_step_s = None
    if settings.step_target_s is not None:
        rows, calibration_step_s = _calibrated_rows(settings)
        settings = replace(settings, rows=rows)
    pipelines: dict[tuple[str, str, int], _pairing.Pipeline] = {}
    build_s: dict[str, float] = {}
    _pairing.share_compilation()
    for m in settings.microbatches:
        tokens, targets = _launch.batch(settings, m, seed=m)
        for library, names in (("zbcompile", settings.zb_schedules), ("torch", settings.torch_schedules)):
            for name in names:
                started = time.perf_counter()
                pipelines[(library, name, m)] = _pipeline(library, name, m, settings, tokens, targets)
                build_s[f"{library} {name} m={m}"] = time.perf_counter() - started
    built = f"built {len(pipelines)} pipelines in {sum(build_s.values()):.0f} s"
    _launch.say(f"{settings.rows} rows per microbatch; {built}")
    warm_started = time.perf_counter()
    for pipeline in pipelines.values():
        pipeline.warm_up()
    _launch.say(f"warmed up in {time.perf_counter() - warm_started:.0f} s")
    loads = [_launch.machine()["loadavg_1_5_15"][0]]

    def timed(key) -> tuple[float, float, measure.Usage]:
        """A step between barriers, then steps back to back; and meanwhile the wall seconds, this
        rank's CPU seconds (all its threads) and the whole machine's busy CPU seconds (rank 0's
        tell how much of the cores other jobs took)."""
        dist.barrier()
        before = measure.Usage.now()
        barrier = pipelines[key].barrier_step()
        loop = pipelines[key].back_to_back(settings.steps_per_round, settings.settle_steps)
        return barrier, loop, measure.Usage.now().since(before)

    def done(r: int, _) -> str:
        loads.append(_launch.machine()["loadavg_1_5_15"][0])
        return f"round {r + 1}/{settings.rounds} done, load {loads[-1]:.2f}"

    rounds = _pairing.rounds(list(pipelines), settings.rounds, timed, after=done)
    barrier_times, times, usage = ({k: [t[i] for t in v] for k, v in rounds.items()} for i in range(3))
    return {
        "times": times, "barrier_times": barrier_times, "usage": usage, "loads": loads,
        "build_s": build_s, "rows": settings.rows, "calibration_step_s": calibration_step_s,
        "zb": {key: p.kept() for key, p in pipelines.items() if isinstance(p, _pairing.ZbPipeline)},
    }


# --- analysis ---------------------------------------------------------------------------------


def _rows(per_rank: list[dict], m: int, chosen: dict, others: dict) -> list[dict]:
    """One row per pipeline at `m` microbatches: its medians over the rounds `chosen` for it, its
    ratios paired by round (all rounds) to torch's best, our 1f1b and torch's 1F1B, the cores'
    worth of CPU `others` used per round, and for zbcompile's pipelines what their timelines say."""
    all_times, all_barrier = per_rank[0]["times"], per_rank[0]["barrier_times"]
    keys = [k for k in all_times if k[2] == m]

    def chosen_median(samples: dict, key) -> float:
        return _launch.median([samples[key][i] for i in chosen[key]])

    loop = {k: chosen_median(all_times, k) for k in keys}
    best = min((k for k in keys if k[0] == "torch"), key=loop.get)
    ours_best = min((k for k in keys if k[0] == "zbcompile" and k[1] in FIXED), key=loop.get)
    torch_1f1b = ("torch", "Schedule1F1B", m)

    def paired(reference, key) -> float:
        return measure.paired_ratio(all_times[reference], all_times[key])

    rows = []
    for key in keys:
        lib, name, _ = key
        row = {
            "library": lib, "schedule": name, "m": m, "step_ms": 1e3 * loop[key], "steps_per_s": 1.0 / loop[key],
            "step_ms_all_rounds": 1e3 * _launch.median(all_times[key]),
            "vs_torch_best": paired(best, key),
            "vs_zbcompile_1f1b": paired(("zbcompile", "1f1b", m), key),
            "vs_torch_1f1b": paired(torch_1f1b, key) if torch_1f1b in keys else None,
            "medians_vs_torch_best": loop[best] / loop[key],
            "torch_best": best[1],
            "barrier_step_ms": 1e3 * chosen_median(all_barrier, key),
            "barrier_step_ms_all_rounds": 1e3 * _launch.median(all_barrier[key]),
            "rounds_used": chosen[key],
            "others_cores": others[key],
            "step_ms_samples": [1e3 * t for t in all_times[key]],
        }
        if lib == "zbcompile":
            row.update(_zb_columns(per_rank, key, row, chosen[key], ours_best[1], paired(ours_best, key)))
        rows.append(row)
    return rows


def _zb_columns(per_rank: list[dict], key, row: dict, rounds: list[int], ours_best: str, vs_ours_best: float) -> dict:
    """What a zbcompile pipeline's runs say beyond its times: the simulator's prediction from the
    per-action medians of `rounds` and the share of its gain captured, the busy-time bound, its
    ratio to our best fixed schedule (`vs_ours_best`, paired), its cut, tuner and moved W."""
    zb = per_rank[0]["zb"][key]
    steps = zip(*([s for r in rounds for s in rank["zb"][key]["samples"][r]] for rank in per_rank))
    prediction = _pairing.predict(zb["schedule"], list(steps))
    predicted, bound = prediction["simulated_steady_gain_over_1f1b"], max(prediction["busy_ms"])
    return {
        "prediction": prediction, "busy_bound_ms": bound, "over_bound": row["step_ms"] / bound,
        "vs_ours_best": vs_ours_best, "ours_best": ours_best,
        "captured_share": (row["vs_zbcompile_1f1b"] - 1) / (predicted - 1) if predicted > 1.005 else None,
        "barrier_over_makespan": row["barrier_step_ms"] / prediction["makespan_ms"],
        "cost_source": zb["cost_source"], "placement": _launch.placement(zb["schedule"]),
        "switch_steps": zb["switch_steps"], "tuner_history": zb["tuner_history"], "cut_record": zb.get("cut_record"),
        "w_into_wait_per_step": [statistics.fmean(x["into_wait"] for x in r["zb"][key]["moved"]) for r in per_rank],
        "w_past_send": [r["zb"][key]["moved"][-1]["past_send"] for r in per_rank],
        "schedule_actions": [" ".join(str(a) for a in r) for r in zb["schedule"].compute_only().actions],
    }


def _targets(rows: list[dict], m: int) -> list[dict]:
    """The `NEVER_BEHIND` targets at `m` microbatches, each with its measured value and whether it holds."""
    wanted = NEVER_BEHIND
    by = {r["schedule"]: r for r in rows if r["m"] == m and r["library"] == "zbcompile"}
    auto, ours = by["zb-auto"], by["1f1b"]
    targets = [
        {"m": m, "target": f"zb-auto steps/s >= {wanted['torch']:.2f}x torch's best (paired)",
         "value": auto["vs_torch_best"], "holds": auto["vs_torch_best"] >= wanted["torch"]},
        {"m": m, "value": auto["vs_ours_best"], "holds": auto["vs_ours_best"] >= wanted["ours"],
         "target": f"zb-auto steps/s >= {wanted['ours']:.2f}x our best fixed ({auto['ours_best']}, paired)"},
        {"m": m, "target": f"zb-auto step <= {wanted['bound']:.2f}x its busy-time bound",
         "value": auto["over_bound"], "holds": auto["over_bound"] <= wanted["bound"]},
    ]
    if ours["vs_torch_1f1b"] is not None:
        targets.append({"m": m, "target": f"zbcompile 1f1b steps/s >= {wanted['1f1b']:.2f}x torch's 1F1B (paired)",
                        "value": ours["vs_torch_1f1b"], "holds": ours["vs_torch_1f1b"] >= wanted["1f1b"]})
    return targets


def analyse(per_rank: list[dict], settings: Settings) -> dict:
    settings = replace(settings, rows=per_rank[0]["rows"])
    all_times = per_rank[0]["times"]
    # per pipeline, the medians use the `quiet_share` of its rounds in which other jobs used the least CPU
    others = {k: _pairing.others_cores([r["usage"][k] for r in per_rank]) for k in all_times}
    chosen = {k: _pairing.quietest(others[k], settings.quiet_share) for k in all_times}
    rows = [row for m in settings.microbatches for row in _rows(per_rank, m, chosen, others)]
    selection = "medians over all rounds" if settings.quiet_share >= 1 else (
        f"steps/s and ms/step: medians over the quietest {settings.quiet_share:.0%} of each pipeline's rounds "
        "(those in which other jobs used the least CPU); the all-rounds median beside them"
    )
    noise_floor = {  # m -> the twin's steps/s over zb-h2's, paired as every ratio here is
        m: measure.paired_ratio(all_times[("zbcompile", "zb-h2", m)], all_times[("zbcompile", TWIN, m)])
        for m in settings.microbatches
        if ("zbcompile", TWIN, m) in all_times and ("zbcompile", "zb-h2", m) in all_times
    }
    return {
        "settings": asdict(settings), "calibration_step_s": per_rank[0]["calibration_step_s"], "selection": selection,
        "load_during_rounds": per_rank[0]["loads"], "build_s": per_rank[0]["build_s"], "rows": rows,
        "targets": [target for m in settings.microbatches for target in _targets(rows, m)], "noise_floor": noise_floor,
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
    loads = data["load_during_rounds"]
    lines = [
        "# Training-step throughput on CPU: zbcompile beside torch.distributed.pipelining",
        "",
        f"{MODEL_NAMES[s.get('model', 'gpt')]} vocab {s['vocab']}, seq {s['seq_len']}, hidden {s['hidden']}, "
        f"heads {s['heads']}, {s['layers']} layers; {sizing}; 2 gloo ranks, 1 thread each. zbcompile: 2 stages split "
        f"at blocks.{s['layers'] // 2}; zb-auto with the pipeline's defaults (the cut chosen by measurement in its "
        "first compile, one stage per rank or a V of two chunks per rank, costs measured over its first steps, "
        "readiness followed), zb-auto(static costs) with `profile=False`, zb-auto(plan order) with "
        "`follow_readiness=False`. torch: the same split for GPipe/1F1B, 4 chunks of "
        f"{s['layers'] // 4} block(s) for the 2-chunks-per-rank schedules.",
        f"{s['warmup']} warm-up steps per pipeline (untimed; zb-auto until it runs its measured schedule), then "
        f"{s['rounds']} rounds alternating over all pipelines (order reversed every other round); per round and "
        f"pipeline: one step between two barriers, then {s['steps_per_round']} steps back to back with the optimizer "
        f"step, as a training loop runs them (steps/s: the steady-state rate, from the end of step {s['settle_steps']} "
        "to the end of the last).",
        f"Machine: {_launch.before_after(data)}; 1-min load during the rounds {min(loads):.1f} to {max(loads):.1f}. "
        f"Run took {data['wall_s']:.0f} s.",
        "",
        "## Steps per second",
        "",
        f"Other jobs' CPU use during each pipeline's rounds (cores, median over all pipelines and rounds): "
        f"{_launch.median([c for r in rows for c in r['others_cores']]):.2f}; {data['selection']}. Ratios are paired: "
        "the median over all rounds of the two pipelines' step-time ratio within each round (the machine's speed "
        "drifts between rounds; torch's best is the one with the best median).",
        "",
        _launch.table(
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
        ),
        "",
        "Busy bound: the slowest rank's actions summed in a step, median over the steps (no schedule's period on "
        "these ranks can be shorter); step / bound: how far the measured step is above it.",
        "",
        "torch best: " + ", ".join(f"m={m}: {a}" for m, a in sorted({(r["m"], r["torch_best"]) for r in rows})),
        "",
        "zb-auto's placement (one stage per rank: in-line; two chunks per rank: v): "
        + ", ".join(f"m={r['m']}: {r['placement']}" for r in rows if r["library"] == "zbcompile"
                    and r["schedule"] == "zb-auto"),
        "",
    ]
    return "\n".join(lines + _time_section(rows) + _targets_section(data) + _decisions_section(rows))


def _time_section(rows: list[dict]) -> list[str]:
    """Where the time goes, per zbcompile pipeline: its per-action medians and the simulator's reading of them."""
    table = _launch.table(
        ["schedule", "m", "F ms (s0/s1)", "I or B ms", "W ms", "comm ms", "busy ms (r0/r1)", "simulated span ms",
         "ms/step", "predicted gain over 1f1b", "measured gain", "captured share", "runtime gaps ms",
         "gap per action us", "W into waits per step (r0/r1)", "W past sends (r0/r1)", "costs"],
        [
            [r["schedule"], r["m"], *("/".join(f"{x:.1f}" for x in p[k]) for k in ("f_ms", "b_ms", "w_ms")),
             f"{p['comm_ms']:.2f}", "/".join(f"{x:.0f}" for x in p["busy_ms"]), f"{p['span_ms']:.1f}",
             f"{r['step_ms']:.1f}", f"{p['simulated_steady_gain_over_1f1b']:.3f}x", f"{r['vs_zbcompile_1f1b']:.3f}x",
             f"{r['captured_share']:.0%}" if r["captured_share"] is not None else "-",
             f"{p['runtime_gaps_ms']:.1f}", f"{p['runtime_gap_per_action_us']:.0f}",
             "/".join(f"{x:.1f}" for x in r["w_into_wait_per_step"]), "/".join(str(x) for x in r["w_past_send"]),
             r["cost_source"]]
            for r in rows if r["library"] == "zbcompile" for p in [r["prediction"]]
        ],
    )
    return [
        "## Where the time goes (zbcompile; per-action medians from the runtime's timelines of the settled steps of "
        "the rounds used)",
        "",
        table,
        "",
        "I or B: the input-gradient backward I where the schedule splits it, else the fused backward B with W = 0 "
        "(stage 0's I computes the activations' gradients, which it sends nowhere). Per-action times exclude waiting "
        "for a message; comm: median delay from a producer's end to the end of a receiver's wait that had begun "
        "before it. Busy: per rank, the sum of its actions' medians over a step (no schedule's period can be shorter "
        "than the larger one). Simulated span: the simulator's longest per-rank span under these costs, the period "
        "back-to-back steps approach. Predicted gain: 1F1B's simulated span over this schedule's, both under this "
        "row's costs (the steady-state gain the simulator promises); measured gain: steps/s over zbcompile 1f1b's, "
        "paired per round; captured share: (measured - 1) / (predicted - 1). Runtime gaps: per step, the larger "
        "per-rank sum of the time between consecutive actions that was not a wait for a message (posting sends and "
        "receives, bookkeeping; the simulator has no such time), and per action. W into waits: W run early while a "
        "computation waited for a message, per step; past sends: W the program runs after a send the plan put them "
        "before. Costs: what the running schedule was solved with.",
        "",
    ]


def _targets_section(data: dict) -> list[str]:
    lines = [
        "## Targets",
        "",
        _launch.table(
            ["m", "target", "measured", "holds"],
            [[t["m"], t["target"], f"{t['value']:.3f}", "yes" if t["holds"] else "NO"] for t in data["targets"]],
        ),
    ]
    if data.get("noise_floor"):
        lines += [
            "",
            "Noise floor (not a target): a second zb-h2 pipeline, identical to the first, measured "
            + ", ".join(f"{v:.3f}x at m={m}" for m, v in sorted(data["noise_floor"].items()))
            + " zb-h2's steps/s, paired the same way: a ratio between equals, the spread the targets above must clear.",
        ]
    return lines


def _decisions_section(rows: list[dict]) -> list[str]:
    """What zb-auto decided by measurement: its switches to measured costs, and its cut."""
    lines = []
    switches = [r for r in rows if r["library"] == "zbcompile" and r["switch_steps"] is not None]
    if switches:
        lines += ["", "## Measured costs", ""]
        for r in switches:
            events = "; ".join(f"step {e['step']}: {e['event']}" for e in r["tuner_history"])
            lines.append(
                f"- m={r['m']} {r['schedule']}: switched to its measured schedule after {r['switch_steps']} warm-up "
                f"steps ({events})"
            )
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
    return lines


def main() -> None:
    parser = _launch.parser(__doc__.split("\n\n")[0], "a smoke run: m=4 only, 1 round, smaller model")
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--steps-per-round", type=int, default=Settings.steps_per_round)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--microbatches", default=",".join(map(str, Settings.microbatches)))
    parser.add_argument("--step-target", type=float, default=Settings.step_target_s,
                        help="seconds a step at the smallest m should take (0: use --rows)")
    parser.add_argument("--rows", type=int, default=Settings.rows)
    parser.add_argument("--all", action="store_true", help="also torch's ScheduleInterleavedZeroBubble")
    parser.add_argument("--model", choices=tuple(MODEL_NAMES), default="gpt",
                        help="the zoo GPT, the Llama-style decoder (8 layers, d=256, vocab 512; m=4,8 unless "
                        "--microbatches), or a tiny one (d=96, seq 32, one row per microbatch; m=16)")
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
            hidden=32, seq_len=16, layers=4 if options.model == "gpt" else 8, microbatches=(4,), rounds=1,
            steps_per_round=3, warmup=1, step_target_s=None, model=options.model, vocab=settings.vocab,
        )
    name = "runtime_cpu" if options.model == "gpt" else f"runtime_cpu_{options.model}"
    _launch.run_and_report(name, 2, rank_main, settings, analyse, report, write=_launch.writes(options))


if __name__ == "__main__":
    main()
