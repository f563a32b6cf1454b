"""New sequence lengths on held-out decoders: a new length's step against a repeated length's, losses against eager.

The acceptance point of variable lengths: held-out decoders (transformers models from tiny random-init configs, no
downloads), default options (no schedule=, dynamic=None), 16 training steps over 9 distinct lengths (`LENGTHS`):
a new length's step at most 1.5x a repeated length's (median), every loss equal to eager's within 1e-5. A step is
what a user runs: `pipe.step(...)`, an SGD step and zero_grad, timed between barriers under torch.distributed (the
slower rank's time); its batch is 8 rows (4 microbatches of 2) of random tokens at that step's length, and the first
step also counts the `compile()` the optimizer is built after. The first length compiles for its shape and the
second compiles once more shape-generically: both are new-length steps and count in the new median, as measured
(the table also gives the median of the new-length steps that did not compile). An eager replica (a deep copy of
the model, same initial weights) trains in lockstep on every rank with the same SGD on the same batch; the loss the
pipeline returns (on the last stage's rank) is compared with the replica's on the same step. Configurations:

- A: LlamaForCausalLM (hidden 128, intermediate 256, 4 layers, 4 heads, 2 kv heads, vocab 256), labels=input_ids
  (the model's own loss), 2-stage pipeline on 2 gloo ranks;
- B: Qwen2ForCausalLM of the same shape, input_ids + attention_mask (all ones) + labels, 2 gloo ranks;
- C: A in one process (no torch.distributed);
- D: A on 4 gloo ranks, 2 data-parallel replicas of 2 stages, `data_parallel="shard"` (each replica passes its own
  half of a batch of twice the rows; the eager replica trains on the whole batch, whose mean loss, the
  replicas' mean, is what `step()` returns on each replica's last stage).

    python benchmarks/new_lengths.py            # a few minutes on 2 quiet cores
    python benchmarks/new_lengths.py --quick    # config C only, 6 steps; writes nothing

Writes benchmarks/results/new_lengths.{json,md}.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import _launch

# 9 distinct lengths over 16 steps; the 7 repeats span the new lengths' range (both medians 112)
LENGTHS = (64, 128, 64, 96, 128, 48, 176, 96, 112, 144, 48, 160, 112, 80, 176, 144)
# name -> (model, ranks (None: one process), data-parallel replicas sharding their state over "dp")
CONFIGS = {"A": ("llama", 2, 1), "B": ("qwen2", 2, 1), "C": ("llama", None, 1), "D": ("llama", 4, 2)}
LIMIT = 1.5  # a new length's median step at most this many times a repeated length's
TOLERANCE = 1e-5  # every loss within this of eager's


@dataclass(frozen=True)
class Settings(_launch.Settings):
    hidden: int = 128
    inner: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    rows: int = 2  # sequences per microbatch
    microbatches: int = 4
    steps: int = len(LENGTHS)
    lr: float = 1e-2
    seed: int = 0


def decoder(settings: Settings, kind: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(settings.seed)
    return model_class(config_class(
        vocab_size=settings.vocab, hidden_size=settings.hidden, intermediate_size=settings.inner,
        num_hidden_layers=settings.layers, num_attention_heads=settings.heads, num_key_value_heads=settings.kv_heads,
    ))


def batch(settings: Settings, kind: str, i: int, replicas: int = 1) -> dict:
    """Step `i`'s keyword arguments: random input_ids at LENGTHS[i] (`replicas` times the rows),
    labels=input_ids (qwen2: an all-ones mask)."""
    import torch

    shape = (settings.rows * settings.microbatches * replicas, LENGTHS[i])
    tokens = torch.randint(0, settings.vocab, shape, generator=torch.Generator().manual_seed(settings.seed + i))
    kwargs = {"input_ids": tokens, "labels": tokens}
    if kind == "qwen2":
        kwargs["attention_mask"] = torch.ones_like(tokens)
    return kwargs


def rank_main(settings: Settings, kind: str, replicas: int = 1) -> dict:
    import torch
    import torch.distributed as dist

    import zbcompile

    distributed = dist.is_initialized()
    model = decoder(settings, kind)
    replica = copy.deepcopy(model)  # eager, trained in lockstep
    replica_optimizer = torch.optim.SGD(replica.parameters(), lr=settings.lr)
    options, mine = {}, 0  # mine: this rank's replica
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas), mesh_dim_names=("dp", "pp"))
        options, mine = {"process_group": mesh, "data_parallel": "shard"}, mesh.get_local_rank("dp")

    def batch_of(i: int) -> tuple[dict, dict]:
        """Step `i`'s whole batch and this replica's part of it."""
        whole = batch(settings, kind, i, replicas)
        return whole, {k: v.chunk(replicas)[mine] for k, v in whole.items()}

    pipe = zbcompile.pipeline(
        model, stages=2, microbatches=settings.microbatches, timeout=settings.timeout_s, **options
    )

    def timed(run):
        if distributed:
            dist.barrier()
        started = time.perf_counter()
        result = run()
        if distributed:
            dist.barrier()
        return time.perf_counter() - started, result

    compile_s, _ = timed(lambda: pipe.compile(**batch_of(0)[1]))  # counted in the first step
    optimizer = torch.optim.SGD(pipe.parameters(), lr=settings.lr)

    def step(kwargs: dict):
        loss = pipe.step(**kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return None if loss is None else float(loss)

    times, losses, eager, builds, symbolic = [], [], [], [], []
    for i in range(settings.steps):
        whole, kwargs = batch_of(i)
        seconds, loss = timed(lambda: step(kwargs))
        times.append(seconds + (compile_s if i == 0 else 0.0))
        losses.append(loss)
        builds.append(len(pipe._builder.builds))  # private: the compiles this pipeline made so far
        symbolic.append(pipe.compiled.traced.symbols is not None)
        parts = [{k: v.chunk(replicas)[r] for k, v in whole.items()} for r in range(replicas)]
        part_losses = [replica(**part).loss for part in parts]  # the whole batch's mean: the replicas' mean
        (sum(part_losses) / replicas).backward()
        replica_optimizer.step()
        replica_optimizer.zero_grad(set_to_none=True)
        eager.append(float(sum(part_losses).detach()) / replicas)  # step() returns the replicas' mean
        _launch.say(f"{kind} step {i + 1}/{settings.steps} L={LENGTHS[i]}: {1e3 * times[-1]:.0f} ms, {builds[-1]} made")
    return {"times": times, "losses": losses, "eager": eager, "builds": builds, "symbolic": symbolic}


def analyse(name: str, per_rank: list[dict], settings: Settings) -> dict:
    steps = range(settings.steps)
    times = [max(r["times"][i] for r in per_rank) for i in steps]
    first = per_rank[0]
    new = [i for i in steps if LENGTHS[i] not in LENGTHS[:i]]
    repeated = [i for i in steps if i not in new]
    builds = [0, *first["builds"]]
    compiled = [i for i in steps if builds[i + 1] > builds[i]]
    diffs = [abs(r["losses"][i] - r["eager"][i]) for r in per_rank for i in steps if r["losses"][i] is not None]
    new_ms = 1e3 * _launch.median([times[i] for i in new])
    repeated_ms = 1e3 * _launch.median([times[i] for i in repeated])
    new_steady = [times[i] for i in new if i not in compiled]
    return {
        "config": name, "model": CONFIGS[name][0], "ranks": CONFIGS[name][1] or 1, "replicas": CONFIGS[name][2],
        "step_s": times,
        "new_steps": new, "repeated_steps": repeated, "compile_steps": compiled, "symbolic": first["symbolic"],
        "losses": [next((r["losses"][i] for r in per_rank if r["losses"][i] is not None), None) for i in steps],
        "eager_losses": first["eager"], "new_median_ms": new_ms, "repeated_median_ms": repeated_ms,
        "ratio": new_ms / repeated_ms, "new_uncompiled_median_ms": 1e3 * _launch.median(new_steady) if new_steady
        else None, "max_loss_diff": max(diffs), "losses_compared": len(diffs),
        "passed": new_ms / repeated_ms <= LIMIT and max(diffs) <= TOLERANCE,
    }


def report(data: dict) -> str:
    s, rows = data["settings"], []
    for c in data["configs"]:
        steady = c["new_uncompiled_median_ms"]
        rows.append([
            f"{c['config']} ({c['model']}, {c['ranks']} rank{'s' * (c['ranks'] > 1)}"
            f"{', dp=2 shard' if c.get('replicas', 1) > 1 else ''})", len(c["step_s"]),
            len(set(LENGTHS[: len(c["step_s"])])), f"{c['new_median_ms']:.0f}", f"{c['repeated_median_ms']:.0f}",
            f"{c['ratio']:.2f}x", "yes" if c["passed"] else "NO", len(c["compile_steps"]), f"{c['max_loss_diff']:.1e}",
            "-" if steady is None else f"{steady:.0f} ({steady / c['repeated_median_ms']:.2f}x)",
        ])
    steps = ["; ".join(f"{LENGTHS[i]}{'*' if i in c['new_steps'] else ''}{'(C)' if i in c['compile_steps'] else ''}"
                       f" {1e3 * t:.0f}" for i, t in enumerate(c["step_s"])) for c in data["configs"]]
    return "\n".join([
        "# New sequence lengths on held-out decoders: new against repeated steps, losses against eager",
        "",
        f"Tiny random-init decoders (hidden {s['hidden']}, intermediate {s['inner']}, {s['layers']} layers, "
        f"{s['heads']} heads, {s['kv_heads']} kv heads, vocab {s['vocab']}), 2 stages, {s['microbatches']} "
        f"microbatches x {s['rows']} rows, default options, SGD lr {s['lr']}; "
        f"lengths {', '.join(map(str, data['lengths']))}. "
        f"Pass: new median <= {LIMIT}x repeated median and every loss within {TOLERANCE:.0e} of an eager replica "
        f"trained in lockstep. Machine: {_launch.before_after(data)}; {data['wall_s']:.0f} s.",
        "",
        _launch.table(
            ["config", "steps", "lengths", "new median ms", "repeated median ms", "ratio", "pass", "compiles",
             "max loss diff", "new w/o compile median ms (vs repeated)"],
            rows,
        ),
        "",
        "Step ms by length (* new length, (C) the library compiled in that step):",
        "",
        *(f"- {c['config']}: {line}" for c, line in zip(data["configs"], steps)),
    ])


def main() -> None:
    options = _launch.parser(__doc__.split("\n\n")[0], "config C only, 6 steps; writes nothing").parse_args()
    settings = Settings(steps=6) if options.quick else Settings()
    names = ["C"] if options.quick else list(CONFIGS)
    before = _launch.machine()
    print(f"machine: {_launch.load_line(before)}", flush=True)
    started, configs = time.perf_counter(), []
    for name in names:
        kind, world, replicas = CONFIGS[name]
        if world is None:
            per_rank = [rank_main(settings, kind)]
        else:
            per_rank = _launch.run_ranks(world, rank_main, settings, kind, replicas, timeout_s=settings.timeout_s)
        configs.append(analyse(name, per_rank, settings))
    data = {
        "settings": asdict(settings), "lengths": LENGTHS[: settings.steps], "machine_before": before,
        "machine_after": _launch.machine(), "wall_s": time.perf_counter() - started, "configs": configs,
    }
    _launch.print_and_write("new_lengths", data, report(data), _launch.writes(options))


if __name__ == "__main__":
    main()
