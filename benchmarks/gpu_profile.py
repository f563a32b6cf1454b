"""Per-stage T_F, T_B, T_W of the paper's 1.5B model on one GPU, beside the paper's Table 9, and
every schedule simulated with them.

The model (GPT, hidden 2304, 24 heads, sequence 1024, 22 layers, vocabulary 50304, LM head tied to
the token embedding as in Megatron-LM) is built on the `meta` device in bf16 and compiled into 8
stages against fake CUDA tensors for one microbatch of 6 sequences; no weights exist yet. Then, one
stage at a time: that stage's parameters are materialised on the GPU (random values), its F, I and W
graphs run on random inputs (warm-up first), each timed with CUDA events, and everything is freed
before the next stage. The measured costs (and the paper's T_comm, which one GPU cannot measure) go
to the simulator for 1F1B, ZB-H1, ZB-H2, ZB-1p / ZB-2p (zb-auto limited to 1x and 2x 1F1B's peak
memory, the same limit on every stage as in the paper), GPipe, interleaved 1F1B and ZB-V at m = 24,
32, 64.

bf16 weights and activations throughout (the paper trained with mixed precision on A100s);
Table 9's 18.522 / 18.086 / 9.337 ms are its per-stage averages on an A100 80GB.

    python benchmarks/gpu_profile.py                      # needs a GPU; says so and exits 0 without one
    python benchmarks/gpu_profile.py --device cpu --tiny  # every code path on a tiny model, on the CPU

Writes benchmarks/results/gpu_profile.{json,md} when run on a GPU (or with --write).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import _launch
import _pairing
from bubble_table import COLUMNS, PAPER
from zbcompile.rehearsal.rehearse import PAPER_TIMES

PAPER_TABLE9 = dict(zip(("T_F", "T_B", "T_W", "T_comm"), PAPER_TIMES["1.5B"][1:5]))  # ms, A100 80GB, 1.5B
PAPER_TABLE5 = {m: PAPER[("1.5B", m)] for m in (24, 32, 64)}  # the paper's stage bubble rates for 1.5B, by m
PAPER_COLUMNS = COLUMNS[:5]  # PAPER_TABLE5's: 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p


@dataclass(frozen=True)
class Config:
    vocab: int = 50304
    seq_len: int = 1024
    hidden: int = 2304
    heads: int = 24
    layers: int = 22
    microbatch: int = 6
    stages: int = 8
    microbatches: tuple[int, ...] = (24, 32, 64)
    dtype: str = "bfloat16"
    warmup: int = 3
    repeats: int = 10
    solver_time_budget: float = 3.0


TINY = Config(
    vocab=64, seq_len=16, hidden=32, heads=4, layers=22, microbatch=2, microbatches=(24, 32), warmup=1, repeats=2,
    solver_time_budget=0.5,
)


# --- one stage at a time ----------------------------------------------------------------------


def _random_inputs(program, have, device):
    """Random tensors (on `device`) for every input of a Program not in `have`, with the traced
    shapes, strides and dtypes; integers in [0, 8) so that they index any embedding or class."""
    import torch

    env = {}
    for node, name in zip(program.graph.graph.find_nodes(op="placeholder"), program.signature.inputs):
        if name in have or name in env:
            continue
        value = node.meta["val"]
        out = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=device)
        if value.is_floating_point():
            out.normal_()
        elif value.dtype == torch.bool:
            out.fill_(True)
        else:
            out.random_(0, 8)
        env[name] = out
    return env


def _materialise(model, compiled, stage: int, device, dtype):
    """This stage's parameters and buffers as real tensors on `device` (random, GPT-2 style
    scales: matrices N(0, 0.02), LayerNorm weights 1, biases 0)."""
    import torch

    from zbcompile.value_names import buffer_name, param_name

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    part = compiled.partition.stages[stage]
    state = {}
    with torch.no_grad():
        for fqn in part.param_fqns:
            meta = params[fqn]
            value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if value.dim() >= 2:
                value.normal_(0.0, 0.02)
            elif fqn.endswith("weight"):
                value.fill_(1.0)
            else:
                value.zero_()
            state[param_name(fqn)] = value
        for fqn in part.buffer_fqns:
            meta = buffers[fqn]
            state[buffer_name(fqn)] = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    return state


def profile_stage(model, compiled, stage: int, device, dtype, config: Config) -> dict:
    """Median ms of F, I (input gradients), W (weight gradients) and the unsplit backward of one
    stage; F, I, W run back to back as in a pipeline step, the unsplit backward separately."""
    import torch

    from zbcompile.value_names import TANGENT

    program = compiled.programs[stage]
    timer = _pairing.DeviceClock(device)
    state = _materialise(model, compiled, stage, device, dtype)
    inputs = _random_inputs(program.forward, state, device)
    samples = {"F": [], "I": [], "W": [], "unsplit": []}
    try:
        with torch.no_grad():
            tangents = None
            for attempt in range(config.warmup + config.repeats):
                env = dict(inputs)
                t0 = timer.mark()
                program.forward.run(env, state)
                t1 = timer.mark()
                if tangents is None:  # gradients of the stage outputs (of the loss on the last stage)
                    tangents = {
                        name: value
                        for name, value in _random_inputs(program.joint.backward, {**state, **env}, device).items()
                        if name.startswith(TANGENT)
                    }
                env.update(tangents)
                saved = dict(env)
                program.input_backward.run(env, state)
                t2 = timer.mark()
                program.weight_backward.run(env, state)
                t3 = timer.mark()
                del env
                t4 = timer.mark()
                program.joint.backward.run(saved, state)
                t5 = timer.mark()
                del saved
                timer.synchronize()
                if attempt >= config.warmup:
                    samples["F"].append(timer.elapsed_ms(t0, t1))
                    samples["I"].append(timer.elapsed_ms(t1, t2))
                    samples["W"].append(timer.elapsed_ms(t2, t3))
                    samples["unsplit"].append(timer.elapsed_ms(t4, t5))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        del state, inputs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    fqns = compiled.partition.stages[stage].param_fqns
    return {
        **{k: _launch.median(v) for k, v in samples.items()},
        "stage": stage, "samples_ms": samples, "params": len(fqns),
        "layers": sorted({int(f.split(".")[1]) for f in fqns if f.startswith("blocks.")}),
        "has_embedding": any(f.startswith("pos_emb") for f in fqns),
        "has_head": any(f.startswith(("head", "ln_f")) for f in fqns),
        "peak_memory_gib": None if peak is None else peak / 2**30,
    }


# --- the simulator --------------------------------------------------------------------------


def simulate_all(stages: list[dict], static, config: Config) -> list[dict]:
    """Every schedule at every m with the measured per-stage costs (ms) and the paper's T_comm."""
    from zbcompile.schedules import Costs, make_schedule, simulate

    p = config.stages
    f = [s["F"] for s in stages]
    b = [s["I"] for s in stages]
    w = [s["W"] for s in stages]
    comm = PAPER_TABLE9["T_comm"]
    costs = Costs(f=f, i=b, w=w, comm=comm, mem_b=static.mem_b, mem_w=static.mem_w)
    # two chunks per rank, each half of that rank's stage: interleaved (rank c % p), V (c, 2p-1-c)
    loop = [c % p for c in range(2 * p)]
    vee = [c if c < p else 2 * p - 1 - c for c in range(2 * p)]

    def chunk_costs(owner):
        return Costs(
            f=[f[r] / 2 for r in owner], i=[b[r] / 2 for r in owner], w=[w[r] / 2 for r in owner], comm=comm,
            mem_b=[static.mem_b[r] / 2 for r in owner], mem_w=[static.mem_w[r] / 2 for r in owner],
        )

    rows = []
    for m in config.microbatches:
        # the paper's limits for ZB-1p / ZB-2p: p (2p) microbatches of the largest stage's activations,
        # 1F1B's peak on its first stage, the same on every stage
        base = p * max(static.mem_b)
        solver = {"time_budget": config.solver_time_budget, "placements": ("in-line",)}
        plans = [
            ("GPipe", "gpipe", p, costs, {}),
            ("1F1B", "1f1b", p, costs, {}),
            ("ZB-H1", "zb-h1", p, costs, {}),
            ("ZB-H2", "zb-h2", p, costs, {}),
            ("ZB-1p", "zb-auto", p, costs, {"memory_limit": base, **solver}),
            ("ZB-2p", "zb-auto", p, costs, {"memory_limit": 2 * base, **solver}),
            ("1F1B-I", "interleaved-1f1b", 2 * p, chunk_costs(loop), {"ranks": p}),
            ("ZB-V", "zbv", 2 * p, chunk_costs(vee), {}),
        ]
        for label, name, chunks, chunk_cost, extra in plans:
            row = {"m": m, "schedule": label, "name": name}
            try:
                started = time.perf_counter()
                schedule = make_schedule(name, chunks, m, chunk_cost, check=False, **extra)
                sim = simulate(schedule, chunk_cost)
                row.update(
                    makespan_ms=sim.makespan, span_ms=sim.span, bubble_rate=sim.bubble_rate,
                    stage_bubble_rate=sim.stage_bubble_rate, peak_memory=list(sim.peak_memory),
                    solve_s=time.perf_counter() - started,
                )
                if label in PAPER_COLUMNS and m in PAPER_TABLE5:
                    row["paper_stage_bubble_rate"] = PAPER_TABLE5[m][PAPER_COLUMNS.index(label)]
            except Exception as error:  # report and go on: the run cannot be repeated interactively
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    return rows


# --- main ----------------------------------------------------------------------------------------


def run(config: Config, device_name: str) -> dict:
    import torch

    from zbcompile.compiler import compile_pipeline
    from zbcompile.models.gpt import lm_loss

    device = torch.device(device_name)
    dtype = getattr(torch, config.dtype)
    with torch.device("meta"):
        model = _launch.gpt(config, tie_embeddings=True)
    model = model.to(dtype)
    tokens = torch.randint(0, config.vocab, (config.microbatch, config.seq_len), device=device)
    started = time.perf_counter()
    compiled = compile_pipeline(model, lm_loss, (tokens,), {}, tokens.roll(-1, 1), config.stages, device=device)
    compile_s = time.perf_counter() - started
    print(f"compiled {config.stages} stages in {compile_s:.1f} s", flush=True)
    static = compiled.schedule_costs()

    stages, errors = [], []
    for s in range(config.stages):
        try:
            result = profile_stage(model, compiled, s, device, dtype, config)
            stages.append(result)
            times = ", ".join(f"{k} {result[k]:.2f} ms" for k in ("F", "I", "W"))
            unsplit = f"unsplit backward {result['unsplit']:.2f} ms"
            print(f"stage {s}: {times}, {unsplit}, layers {result['layers']}", flush=True)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            errors.append({"stage": s, "error": failure, "traceback": traceback.format_exc()})
            print(f"stage {s}: FAILED {failure}", flush=True)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
    simulated = simulate_all(stages, static, config) if len(stages) == config.stages else []
    device_info = {"type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_info.update(
            name=props.name, memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}"
        )
    return {
        "config": asdict(config), "device": device_info, "machine": _launch.machine(), "compile_s": compile_s,
        "static_costs": {k: list(getattr(static, k)) for k in ("f", "i", "w", "mem_b", "mem_w")},
        "stages": stages, "errors": errors, "paper_table9_ms": PAPER_TABLE9, "simulated": simulated,
    }


def report(data: dict) -> str:
    c = data["config"]
    dev = data["device"]
    lines = [
        "# Per-stage F/I/W of the paper's 1.5B model on one GPU",
        "",
        f"GPT vocab {c['vocab']}, seq {c['seq_len']}, hidden {c['hidden']}, {c['heads']} heads, {c['layers']} layers, "
        f"microbatch {c['microbatch']}, {c['stages']} stages; {c['dtype']} weights and activations; "
        f"device {dev.get('name', dev['type'])}; {c['warmup']} warm-up and {c['repeats']} timed runs per stage, medians"
        f" ({'CUDA events' if dev['type'] == 'cuda' else 'perf_counter'}). Compiled in {data['compile_s']:.1f} s.",
        "",
        "## T_F, T_B, T_W per stage (ms) beside the paper's Table 9 (A100, per-stage average)",
        "",
    ]
    rows = []
    for s in data["stages"]:
        where = (
            ("emb + " if s["has_embedding"] else "")
            + (f"layers {s['layers'][0]}-{s['layers'][-1]}" if s["layers"] else "no layers")
            + (" + head" if s["has_head"] else "")
        )
        rows.append([s["stage"], where, f"{s['F']:.2f}", f"{s['I']:.2f}", f"{s['W']:.2f}", f"{s['unsplit']:.2f}",
                     f"{(s['I'] + s['W']) / s['unsplit']:.3f}" if s["unsplit"] else "-",
                     "-" if s["peak_memory_gib"] is None else f"{s['peak_memory_gib']:.1f}"])
    if data["stages"]:
        n = len(data["stages"])
        mean = {k: sum(s[k] for s in data["stages"]) / n for k in ("F", "I", "W", "unsplit")}
        rows.append(["mean", "", *(f"{mean[k]:.2f}" for k in ("F", "I", "W", "unsplit")), "", ""])
    p9 = data["paper_table9_ms"]
    rows.append(["paper", "A100, Table 9", f"{p9['T_F']:.2f}", f"{p9['T_B']:.2f}", f"{p9['T_W']:.2f}", "", "", ""])
    header = ["stage", "contents", "T_F", "T_B", "T_W", "unsplit backward", "(I+W)/unsplit", "peak GiB"]
    lines.append(_launch.table(header, rows))
    for e in data["errors"]:
        lines += ["", f"stage {e['stage']} failed: {e['error']}"]
    if data["simulated"]:
        lines += [
            "",
            f"## Simulated with these costs (T_comm {p9['T_comm']} ms, the paper's), all schedules",
            "",
            "bubble: 1 - busy / (p x makespan); stage bubble: the paper's, 1 - busy / (p x span). ZB-1p / ZB-2p: "
            "zb-auto limited to p / 2p microbatches of the largest stage's activations on every stage (1x / 2x 1F1B's "
            "peak). 1F1B-I and ZB-V: two chunks per GPU, each half of that GPU's measured stage.",
            "",
        ]
        rows = []
        for r in data["simulated"]:
            if "error" in r:
                rows.append([r["m"], r["schedule"], "error: " + r["error"], "", "", "", ""])
                continue
            paper = r.get("paper_stage_bubble_rate")
            rows.append([
                r["m"], r["schedule"], f"{r['makespan_ms']:.1f}", f"{r['span_ms']:.1f}", f"{r['bubble_rate']:.4f}",
                f"{r['stage_bubble_rate']:.4f}", "" if paper is None else f"{paper:.4f}",
            ])
        header = ["m", "schedule", "makespan ms", "span ms", "bubble", "stage bubble", "paper (Table 5)"]
        lines.append(_launch.table(header, rows))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (for checking the script)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same shape (22 layers, 8 stages)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (default) or float32")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--write", action="store_true", help="write the results even when not on a GPU")
    options = parser.parse_args()
    import torch

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): nothing to profile; "
              "use --device cpu --tiny to check the script")
        return 0
    config = TINY if options.tiny else Config()
    overrides = {"dtype": options.dtype, "repeats": options.repeats}
    config = replace(config, **{k: v for k, v in overrides.items() if v})
    if options.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    data = run(config, options.device)
    _launch.print_and_write("gpu_profile", data, report(data), options.device.startswith("cuda") or options.write)
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
