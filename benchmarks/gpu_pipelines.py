"""Step times of NCCL pipelines, one GPU per rank: zbcompile's 1f1b, zb-h1, zb-auto (default
options) and zbv beside torch.distributed.pipelining's Schedule1F1B, ScheduleZBVZeroBubble and
ScheduleDualPipeV, on the same GPT in bf16, cut alike (even blocks per stage; zb-auto cuts where
it measures), in one run.

Every pipeline is built in every rank up front (the pipeline and torch's stages, the classes of
benchmarks/runtime_cpu.py on this rank's GPU) and warmed up (zb-auto until it switched to its
measured schedule); then rounds alternate between them (the order reversed every other round),
each timing a few training steps (step, optimizer step) back to back between two barriers, the
device synchronised at both ends; a round's time is the slowest rank's. Reported: the median ms
per step, and the ratio to torch's best and to zbcompile's 1f1b paired within each round.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_pipelines.py --out results.json
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_pipelines.py --device cpu   # gloo, tiny: every path

benchmarks/gpu_check.sh runs it with 2 and 4 ranks where the machine has the GPUs. Rank 0 writes
one JSON object to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _launch  # noqa: E402
import _pairing  # noqa: E402
from runtime_cpu import Settings  # noqa: E402
from zbcompile.measure import paired_ratio  # noqa: E402

ZB = ("1f1b", "zb-h1", "zb-auto", "zbv")
TORCH = ("Schedule1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
GPU = Settings(
    vocab=32768, seq_len=1024, hidden=2048, heads=16, layers=16, rows=4, step_target_s=None,
    microbatches=(8,), warmup=2, rounds=4, steps_per_round=3, timeout_s=240.0, device="cuda", dtype="bfloat16",
)
TINY = replace(
    GPU, vocab=64, seq_len=16, hidden=32, heads=4, layers=8, rows=2, rounds=2, steps_per_round=2, device="cpu",
    dtype="float32",
)


def run(settings: Settings) -> dict:
    """Every rank: build, warm up and time every pipeline; rank 0's result holds the table's data."""
    import torch
    import torch.distributed as dist

    device = _pairing.rank_device(settings.device)
    clock = _pairing.DeviceClock(device)
    m = settings.microbatches[0]
    tokens, targets = (t.to(device) for t in _launch.batch(settings, m, seed=m))
    pipelines = {f"zbcompile {n}": _pairing.ZbPipeline(n, m, settings, tokens, targets) for n in ZB}
    pipelines |= {f"torch {n}": _pairing.TorchPipeline(n, m, settings, tokens, targets) for n in TORCH}
    for pipeline in pipelines.values():
        pipeline.warm_up()

    def timed(name: str) -> float:
        """Seconds per step of the round's steps back to back, the device synchronised at both ends:
        the slowest rank's."""
        clock.synchronize()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(settings.steps_per_round):
            pipelines[name].step()
            pipelines[name].optimize()
        clock.synchronize()
        seconds = (time.perf_counter() - started) / settings.steps_per_round
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    samples = _pairing.rounds(list(pipelines), settings.rounds, timed)
    chosen = pipelines["zbcompile zb-auto"].pipe.schedule
    return {
        "ranks": dist.get_world_size(), "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "settings": asdict(settings), "samples_s": samples,
        "zb_auto": {"schedule": chosen.name, "placement": chosen.info.get("placement", "in-line")},
    }


def analyse(data: dict) -> dict:
    """Medians and paired ratios: per round, torch's best schedule's time and our 1f1b's over each one's."""
    samples = data["samples_s"]
    rounds = len(next(iter(samples.values())))
    torch_best = [min(samples[f"torch {n}"][r] for n in TORCH) for r in range(rounds)]
    ours_1f1b = samples["zbcompile 1f1b"]
    rows = [
        {"pipeline": name, "median_ms": round(1e3 * statistics.median(values), 2),
         "vs_torch_best": round(paired_ratio(torch_best, values), 3),
         "vs_zbcompile_1f1b": round(paired_ratio(ours_1f1b, values), 3)}
        for name, values in samples.items()
    ]
    return {**data, "rows": rows}


def report(data: dict) -> str:
    s = data["settings"]
    head = (
        f"{data['ranks']} ranks ({data['backend']}, {data['device']}); GPT vocab {s['vocab']}, seq {s['seq_len']}, "
        f"hidden {s['hidden']}, {s['layers']} layers, {s['dtype']}; m={s['microbatches'][0]} x {s['rows']} rows; "
        f"zb-auto ran {data['zb_auto']['schedule']} ({data['zb_auto']['placement']}); "
        f"{s['rounds']} rounds x {s['steps_per_round']} steps"
    )
    table = _launch.table(
        ["pipeline", "ms/step (median)", "vs torch's best (paired)", "vs zbcompile 1f1b (paired)"],
        [[r["pipeline"], r["median_ms"], f"{r['vs_torch_best']:.3f}x", f"{r['vs_zbcompile_1f1b']:.3f}x"]
         for r in data["rows"]],
    )
    return f"{head}\n\n{table}\n"


def main() -> int:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo and a tiny model")
    parser.add_argument("--out", default=None, help="rank 0 writes the JSON here")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        print("gpu_pipelines: no CUDA device here; nothing measured")
        return 0
    settings = GPU if options.device == "cuda" else TINY
    if options.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if options.device == "cuda" else "gloo")
    try:
        data = run(settings)
        if dist.get_rank() == 0:
            data = analyse(data)
            print(report(data), flush=True)
            if options.out:
                with open(options.out, "w") as f:
                    json.dump(data, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
