"""`zbcompile plan MODEL`: `zbcompile.plan()` from the command line, in one CPU process.

    zbcompile plan config.json --stages 8 --microbatches 32 --dp 8 --seq-len 4096 --hardware H100-80GB
    zbcompile plan mypkg.models:build --stages 4 --microbatches 16 --svg zb-auto.svg --json plan.json
    zbcompile plan config.json --gpus 64 --global-batch 256 --seq-len 4096     # search the layout

MODEL is a transformers `config.json` (or a directory holding one; the causal LM it describes is
built on the meta device from the config alone: nothing is downloaded, no weight allocated; the
batch is `--batch` sequences of `--seq-len` token ids, which are also the labels; with `--gpus`,
`--global-batch` sequences over every replica), or
`module:function`, a factory called under `torch.device("meta")` that returns either a model
taking token ids and `labels=` as a causal LM does (the same batch), or a dict with "model" and
the batch: "inputs" (a tuple), "kwargs", "target", "loss_fn" (all optional).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from zbcompile.planner.hardware import NAMED
from zbcompile.schedules.memory_limit import DATA_PARALLEL_MODES

DTYPES = ("bfloat16", "float16", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="stages, memory per rank, schedules and predicted step time, before the GPUs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="a transformers config.json (or its directory), or module:function")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (one per rank)")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument(
        "--gpus", type=int, default=None,
        help="search the layout (pp x tp x dp x microbatch size x schedule x recomputation) of this many GPUs",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --gpus: GPUs of a node (tp stays inside)")
    parser.add_argument("--global-batch", type=int, default=None, help="with --gpus: sequences per step, all replicas")
    parser.add_argument(
        "--batch", type=int, default=None, help="sequences per replica per step (default: one per microbatch)"
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (config models)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter dtype (config models)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--data-parallel", choices=DATA_PARALLEL_MODES, default="replicate")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per stage (the model's own plan: transformers')"
    )
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard the sequence too")
    parser.add_argument(
        "--hardware", default="H100-80GB",
        help=f"one of {', '.join(NAMED)}, or a JSON file; or one per rank, comma-separated (ranks of different kinds)",
    )
    parser.add_argument("--memory-limit", default=None, help="bytes per rank, e.g. 70GB (default: the device's memory)")
    parser.add_argument("--schedules", default=None, help="comma-separated schedules to plan")
    parser.add_argument("--svg", default=None, metavar="PATH", help="write zb-auto's predicted timeline there")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the plan's record there")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zbcompile.planner.plan import PLANNED_SCHEDULES, plan

    try:
        _check_layout_arguments(args)
        model, inputs, kwargs, target, loss_fn = build(args)
        if args.gpus is not None:
            return _searched(args, plan(
                model, *inputs, target=target, hardware=args.hardware, memory_limit=args.memory_limit,
                loss_fn=loss_fn, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                sequence_parallel=args.sequence_parallel, **kwargs,
            ))
        schedules = tuple(args.schedules.split(",")) if args.schedules else PLANNED_SCHEDULES
        result = plan(
            model, *inputs, stages=args.stages, microbatches=args.microbatches, target=target,
            hardware=args.hardware.split(",") if "," in args.hardware else args.hardware,
            dp=args.dp, data_parallel=args.data_parallel, memory_limit=args.memory_limit, loss_fn=loss_fn,
            schedules=schedules, tp=args.tp, sequence_parallel=args.sequence_parallel, **kwargs,
        )
    except (ValueError, TypeError, ImportError, OSError) as error:
        print(f"zbcompile plan: {error}", file=sys.stderr)
        return 2
    print(result)
    if args.svg:
        chosen = "zb-auto" if "zb-auto" in result.schedules else next(iter(result.schedules), None)
        if chosen is None:
            print("zbcompile plan: no schedule could be made, no timeline written", file=sys.stderr)
        else:
            result.write_svg(chosen, args.svg)
            print(f"timeline ({chosen}): {args.svg}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result.record, file, indent=1, default=str)
        print(f"record: {args.json}")
    return 0


def _check_layout_arguments(args: argparse.Namespace) -> None:
    if args.gpus is None:
        if args.stages is None or args.microbatches is None:
            raise ValueError("give --stages and --microbatches (a layout), or --gpus and --global-batch (a search)")
        return
    if args.global_batch is None:
        raise ValueError("--gpus searches the layout for a global batch: give --global-batch (sequences per step)")
    given = [f"--{n.replace('_', '-')}" for n in ("stages", "microbatches", "batch") if getattr(args, n) is not None]
    given += [f"--{n}" for n in ("dp", "tp") if getattr(args, n) != 1]
    if given:
        raise ValueError(f"--gpus searches the layout; drop {', '.join(given)}")


def _searched(args: argparse.Namespace, found: Any) -> int:
    print(found)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(found.record, file, indent=1, default=str)
        print(f"record: {args.json}")
    return 0 if found.best is not None else 1


def build(args: argparse.Namespace) -> tuple[Any, tuple, dict, Any, Any]:
    """(model, inputs, kwargs, target, loss_fn) on the meta device, from MODEL."""
    import torch

    batch = args.global_batch if args.gpus is not None else args.batch or args.microbatches
    tokens = torch.zeros(batch, args.seq_len, dtype=torch.long, device="meta")
    language_model_batch = ((tokens,), {"labels": tokens}, None, None)
    if args.model.endswith(".json") or os.path.isdir(args.model):
        return (config_model(args.model, getattr(torch, args.dtype)), *language_model_batch)
    module_name, _, function_name = args.model.partition(":")
    if not function_name:
        raise ValueError(f"MODEL {args.model!r} is neither a config.json nor module:function")
    factory = getattr(importlib.import_module(module_name), function_name)
    with torch.device("meta"):
        made = factory()
    if isinstance(made, torch.nn.Module):
        return (made, *language_model_batch)
    if not isinstance(made, dict) or "model" not in made:
        raise TypeError(
            f"{args.model} must return an nn.Module or a dict with 'model' (and the batch); got {type(made).__name__}"
        )
    return (
        made["model"],
        tuple(made.get("inputs", ())),
        dict(made.get("kwargs", {})),
        made.get("target"),
        made.get("loss_fn"),
    )


def config_model(path: str, dtype: Any) -> Any:
    """The causal LM a transformers config.json describes, on the meta device, in training mode
    without a key/value cache."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as handle:
        values = json.load(handle)
    if "model_type" not in values:
        raise ValueError(f"{file} has no 'model_type'; is it a transformers config.json?")
    config = AutoConfig.for_model(**values)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()
