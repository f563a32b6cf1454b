"""Compile time of a 24-layer GPT (hidden 256) cut into 4 stages: trace, partition, per-stage
joint graphs and the I/W split, each phase timed. Prints a table and writes
benchmarks/results/compile_time.json."""

from __future__ import annotations

import json
import pathlib
import time

import torch

from zbcompile.compiler import compile_pipeline
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=128, hidden=256, heads=4, layers=24)
    model = GPT(config)
    tokens = torch.randint(0, 256, (4, 128))
    started = time.perf_counter()
    compiled = compile_pipeline(model, lm_loss, (tokens,), {}, tokens.roll(1, 1), stages=4)
    total = time.perf_counter() - started
    phases = dict(compiled.phase_seconds)
    print(f"GPT {config.layers} layers, hidden {config.hidden}, seq {config.seq_len}, microbatch 4, 4 stages")
    for phase, seconds in phases.items():
        print(f"  {phase:15s} {seconds:7.2f} s")
    print(f"  {'total':15s} {total:7.2f} s   (target: under 15 s on 2 cores)")
    out = pathlib.Path(__file__).parent / "results" / "compile_time.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": config.__dict__, "phases_s": phases, "total_s": total}, indent=2) + "\n")


if __name__ == "__main__":
    main()
