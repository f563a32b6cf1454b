"""Train a tiny transformers Llama on the bundled text as a zero-bubble pipeline under torchrun,
with held-out evaluation, checkpoints and resumption, and compare it with eager training.

    torchrun --nproc-per-node 2 examples/finetune_llama.py
    torchrun --nproc-per-node 2 examples/finetune_llama.py --resume   # goes on from the latest checkpoint

The model (random initialisation, no downloads; bytes as tokens) computes its own loss from
`labels`, so each step's loss is the whole batch's (the pipeline passes `num_items_in_batch`).
The pipeline has default options: zb-auto, costs measured over the first steps. Every
`--eval-every` steps `pipe.evaluate()` computes the loss of held-out text (the end of the file,
never trained on); every `--checkpoint-every` steps `zbcompile.checkpoint.save` writes a
checkpoint, with the loss history so far, that `--resume` loads. At the end the first rank trains
the same model eagerly in one process on the same batches, and writes the curves of both runs
(`--out`, a PNG) and their numbers (the same name with `.json`)."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import zbcompile
from zbcompile import checkpoint

HELD_OUT = 0.15  # the share of the text at its end used for evaluation only
CONFIG = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)


def text_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled text as byte tokens: (the training part, the held-out end)."""
    data = importlib.resources.files("zbcompile").joinpath("data/tiny.txt").read_bytes()
    tokens = torch.tensor(list(data), dtype=torch.long)
    cut = int(len(tokens) * (1 - HELD_OUT))
    return tokens[:cut], tokens[cut:]


def training_batch(tokens: torch.Tensor, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """Step `step`'s batch: `batch` random windows of the training text (the same for a step
    whatever ran before, so that a resumed run reads what the uninterrupted one reads)."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def held_out_batch(tokens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """`batch` windows spread evenly over the held-out text."""
    starts = torch.linspace(0, len(tokens) - seq_len, batch).long()
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def new_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


def eager_run(args: argparse.Namespace, train: torch.Tensor, held_out: torch.Tensor) -> dict[str, dict[int, float]]:
    """The same training in one process, without a pipeline: each step's loss on the whole
    batch, and the held-out loss (eval mode, no gradients) at the same steps."""
    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    evaluation = held_out_batch(held_out, args.batch, args.seq_len)
    history: dict[str, dict[int, float]] = {"train": {}, "eval": {}}
    for step in range(args.steps):
        tokens = training_batch(train, step, args.batch, args.seq_len)
        optimizer.zero_grad()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        history["train"][step] = loss.item()
        if (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                history["eval"][step] = model(evaluation, labels=evaluation).loss.item()
            model.train()
    return history


def write_results(path: str, pipelined: dict, eager: dict) -> None:
    """The curves (PNG at `path`) and the numbers (JSON beside it) of both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=110)
    for run, style in ((pipelined, dict(linewidth=3, alpha=0.45)), (eager, dict(linewidth=1, linestyle="--"))):
        name = "pipelined" if run is pipelined else "eager"
        steps = sorted(run["train"])
        axes.plot(
            [s + 1 for s in steps],
            [run["train"][s] for s in steps],
            label=f"training loss, {name}",
            color="C0",
            **style,
        )
        steps = sorted(run["eval"])
        marker = dict(marker="o", markersize=9, alpha=0.45) if run is pipelined else dict(marker="x", markersize=7)
        axes.plot([s + 1 for s in steps], [run["eval"][s] for s in steps], label=f"held-out loss, {name}", color="C1",
                  linestyle="-" if run is pipelined else ":", **marker)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per byte)")
    axes.set_title("Tiny Llama on the bundled text: zbcompile pipeline (2 ranks) and eager")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    numbers = {run: {kind: {str(s): v for s, v in values.items()} for kind, values in history.items()}
               for run, history in (("pipelined", pipelined), ("eager", eager))}
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(numbers, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default="finetune_llama_checkpoints")
    parser.add_argument("--resume", action="store_true", help="go on from the latest complete checkpoint")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="finetune_llama.png")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    started = time.perf_counter()
    train, held_out = text_tokens()
    evaluation = held_out_batch(held_out, args.batch, args.seq_len)
    pipe = zbcompile.pipeline(new_model(), stages=dist.get_world_size(), microbatches=args.microbatches)
    first = training_batch(train, 0, args.batch, args.seq_len)
    pipe.compile(first, labels=first)  # before the optimizer: this rank's parameters only
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    # the losses this rank saw (on the rank holding the last stage), by step
    history: dict[str, dict[int, float]] = {"train": {}, "eval": {}}
    start = 0
    path = checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if path is not None:
        extra = checkpoint.load(path, pipe, optimizer)
        start, history = extra["next_step"], extra["history"]
        print(f"rank {rank}: resumed from {path} at step {start}", flush=True)
    elif args.resume:
        print(f"rank {rank}: no checkpoint in {args.checkpoint_dir!r}; starting from step 0", flush=True)

    for step in range(start, args.steps):
        tokens = training_batch(train, step, args.batch, args.seq_len)
        optimizer.zero_grad()
        loss = pipe.step(tokens, labels=tokens)
        optimizer.step()
        if loss is not None:
            history["train"][step] = loss.item()
            print(f"rank {rank} step {step:3d} loss {loss.item():.6f}", flush=True)
        if (step + 1) % args.eval_every == 0:
            held_out_loss = pipe.evaluate(evaluation, labels=evaluation)
            if held_out_loss is not None:
                history["eval"][step] = held_out_loss.item()
                print(f"rank {rank} step {step:3d} held-out loss {held_out_loss.item():.6f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0:
            # every rank saves the whole history (one gather per checkpoint, none per step)
            history = merged(history)
            checkpoint.save(os.path.join(args.checkpoint_dir, f"step_{step + 1:06d}"), pipe, optimizer,
                            next_step=step + 1, history=history)

    history = merged(history)
    if rank == 0:
        eager = eager_run(args, train, held_out)
        write_results(args.out, history, eager)
        print(f"{'step':>5} {'pipelined':>10} {'eager':>10} {'held-out':>10} {'eager':>10}")
        for step in range(args.steps):
            row = [
                history["train"].get(step),
                eager["train"].get(step),
                history["eval"].get(step),
                eager["eval"].get(step),
            ]
            print(f"{step:5d} " + " ".join(f"{v:10.6f}" if v is not None else f"{'':>10}" for v in row))
        print(f"wrote {args.out} and its .json in {time.perf_counter() - started:.1f}s")
    dist.destroy_process_group()


def merged(history: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Every rank's `history` merged (each loss lives on the rank that held the last stage)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, history)
    return {kind: {s: v for h in gathered for s, v in h[kind].items()} for kind in history}


if __name__ == "__main__":
    main()
