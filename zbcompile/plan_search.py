"""`zbcompile.plan(model, *batch, gpus=N)`: how to lay the model out over N GPUs for this global
batch (`layout_search.py` searches; `plan_units.py` compiles the model once for it).

    found = zbcompile.plan(model, tokens, labels=tokens, gpus=64, hardware="H100-80GB")
    print(found)                # the best layouts: step, tokens/s, MFU, memory; why others were dropped
    found.best.layout           # pp, tp, dp, data_parallel, microbatch_size, microbatches

The batch is the global batch (every replica's samples; meta tensors welcome): the search splits
it over dp replicas and microbatches itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile._torch_internals import pytree
from zbcompile.hardware import Hardware, resolve_hardware
from zbcompile.inspect.plan_report import search_text
from zbcompile.layout_search import Layout, Outcome, SearchResult, SearchSettings, nearest, search, step_rates
from zbcompile.passes.tensor_parallel_shares import model_plan, split_mismatch
from zbcompile.plan_units import LEVEL_NAMES, model_units
from zbcompile.schedules.memory_limit import parse_bytes

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class LayoutPlan:
    """The search's answer: `result` (`layout_search.SearchResult`) and its JSON-able `record`,
    which `str()` prints."""

    result: SearchResult
    record: dict[str, Any]

    @property
    def best(self) -> Outcome | None:
        return self.result.best

    def __str__(self) -> str:
        return search_text(self.record)


def plan_layouts(
    model: nn.Module,
    inputs: tuple,
    kwargs: dict,
    target: Any,
    *,
    gpus: int,
    gpus_per_node: int = 8,
    hardware: Hardware | str = "H100-80GB",
    memory_limit: float | str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer_factor: float = 2.0,
    grad_factor: float = 1.0,
    tensor_parallel: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    data_parallel: Sequence[str] = ("replicate", "shard"),
    keep: int = 5,
    near: Layout | None = None,
) -> LayoutPlan:
    """The `keep` fastest layouts of `model` over `gpus` GPUs (`gpus_per_node` to a node) for the
    global batch `inputs`, `kwargs`, `target` that fit `memory_limit` bytes per GPU (default:
    the device's memory); tp > 1 where the model has a tensor-parallel plan (`tensor_parallel`,
    or a transformers model's own) that splits it. With `near`, the record also names the
    fitting layouts closest to it."""
    device = resolve_hardware(hardware)
    limit = device.memory if memory_limit is None else (
        parse_bytes(memory_limit) if isinstance(memory_limit, str) else float(memory_limit)
    )
    tensors = [x for x in pytree.tree_leaves((inputs, kwargs, target)) if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("plan(gpus=...): the batch needs a tensor whose first dimension counts the samples")
    global_batch = tensors[0].shape[0]
    parallel_plan, refused = _tensor_parallel_degrees(model, tensor_parallel, gpus_per_node)
    tps = tuple(t for t in TP_DEGREES if t not in refused and t <= gpus_per_node)

    def batch_of(b: int) -> tuple[tuple, dict, Any]:
        return pytree.tree_map(lambda x: x[:b] if isinstance(x, torch.Tensor) else x, (tuple(inputs), dict(kwargs),
                                                                                       target))

    units = model_units(model, batch_of, device, tps, parallel_plan, sequence_parallel, loss_fn)
    settings = SearchSettings(
        gpus=gpus, global_batch=global_batch, memory_limit=limit, link_bandwidth=device.link_bandwidth,
        gpus_per_node=gpus_per_node, optimizer_factor=optimizer_factor, grad_factor=grad_factor,
        data_parallel=tuple(data_parallel), keep=keep,
        allreduce_seconds_per_byte=lambda dp: device.allreduce_seconds(1.0, dp),
    )
    result = search(units, settings)
    result.peak_flops = device.flops
    result.dropped[:0] = [(f"tp={t}", why) for t, why in refused.items()]
    return LayoutPlan(result, search_record(result, device, near))


def _tensor_parallel_degrees(
    model: nn.Module, given: Mapping[str, Any] | None, gpus_per_node: int
) -> tuple[dict[str, Any] | None, dict[int, str]]:
    """The tensor-parallel plan (None where the model has none) and the degrees it cannot take,
    with why."""
    try:
        plan = model_plan(model, given)
    except ValueError as error:
        return None, {t: str(error).split(";")[0] for t in TP_DEGREES if t > 1}
    refused = {}
    for t in TP_DEGREES[1:]:
        why = split_mismatch(model, plan, t) or (f"above the {gpus_per_node} GPUs of a node" if t > gpus_per_node
                                                  else "")
        if why:
            refused[t] = why
    return plan, refused


def outcome_record(result: SearchResult, outcome: Outcome) -> dict[str, Any]:
    """One layout's line: the layout, its option, step, rates, memory."""
    layout = outcome.layout
    return {
        "pp": layout.pp, "tp": layout.tp, "dp": layout.dp, "data_parallel": layout.data_parallel,
        "microbatch_size": layout.microbatch_size, "microbatches": layout.microbatches,
        "schedule": outcome.option.name, "recompute": LEVEL_NAMES[outcome.option.level],
        "cut": outcome.option.cut, "step": outcome.step, "busy": outcome.busy,
        "peak_bytes": max(outcome.peaks), **step_rates(result, outcome),
    }


def search_record(result: SearchResult, hardware: Hardware, near: Layout | None = None) -> dict[str, Any]:
    """The JSON-able record `inspect/plan_report.search_text` prints."""
    s = result.settings
    reasons: dict[str, list[str]] = {}
    for what, why in result.dropped:
        reasons.setdefault(why, []).append(what)
    record = {
        "gpus": s.gpus, "gpus_per_node": s.gpus_per_node, "global_batch": s.global_batch,
        "tokens_per_sample": result.tokens_per_sample, "hardware": hardware.name, "memory_limit_bytes": s.memory_limit,
        "seconds": result.seconds, "options": result.options, "priced": len(result.priced), "pruned": result.pruned,
        "layouts": [outcome_record(result, o) for o in result.ranked],
        "dropped": [{"why": why, "count": len(what), "examples": what[:2]} for why, what in reasons.items()],
    }
    if near is not None:
        record["near"] = str(near)
        record["nearest"] = [outcome_record(result, o) for o in nearest(result, near)]
    return record
