"""`zbcompile demo`: compile the example GPT into a pipeline, show what the compiler did, and
train it for a few steps on the text shipped with the package."""

from __future__ import annotations

import argparse
import importlib.resources
import time

import torch

import zbcompile
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.schedules import simulate
from zbcompile.summary import stage_table


def text_batches(batch: int, seq_len: int, generator: torch.Generator):
    """Endless random windows of the bundled text as (tokens, next tokens), bytes as tokens."""
    data = importlib.resources.files("zbcompile").joinpath("data/tiny.txt").read_bytes()
    tokens = torch.tensor(list(data), dtype=torch.long)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, hidden=args.hidden, heads=4, layers=args.layers)
    model = GPT(config)
    pipe = zbcompile.pipeline(
        model, stages=args.stages, microbatches=args.microbatches, loss_fn=lm_loss, schedule=args.schedule
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    batches = text_batches(args.batch, args.seq_len, torch.Generator().manual_seed(0))
    print(f"GPT: {config.layers} layers, hidden {config.hidden}, {sum(p.numel() for p in pipe.parameters()):,} parameters")
    print(f"pipeline: {args.stages} stages, {args.microbatches} microbatches, schedule {args.schedule!r}\n")
    for step in range(args.steps):
        tokens, targets = next(batches)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = pipe.step(tokens, target=targets)
        optimizer.step()
        elapsed = time.perf_counter() - started
        if step == 0:
            print("what the compiler did (per microbatch):")
            print(stage_table(pipe.compiled))
            print(f"\nschedule {pipe.schedule.name}:")
            print(pipe.schedule.grid())
            result = simulate(pipe.schedule, zbcompile.api.schedule_costs(pipe.compiled))
            print(f"simulated from FLOP estimates: bubble rate {result.bubble_rate:.1%}\n")
        print(f"step {step:3d}  loss {loss.item():.4f}  {tokens.numel() / elapsed:,.0f} tokens/s")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="compile and train a small GPT as a pipeline")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="zb-h1")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.set_defaults(func=run)
