"""`zbcompile.plan(model, *batch, gpus=N)`: how to lay the model out over N GPUs for this global
batch (`planner/search.py` searches; `planner/units.py` compiles the model once for it).

    found = zbcompile.plan(model, tokens, labels=tokens, gpus=64, hardware="H100-80GB")
    print(found)                # the best layouts: step, tokens/s, MFU, memory; why others were dropped
    found.best.layout           # pp, tp, dp, data_parallel, microbatch_size, microbatches

The batch is the global batch (every replica's samples; meta tensors welcome): the search splits
it over dp replicas and microbatches itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile._torch_internals import pytree
from zbcompile.compiler import CostedPipeline
from zbcompile.passes.tensor_parallel_shares import model_plan, split_mismatch
from zbcompile.planner.hardware import Hardware, resolve_hardware
from zbcompile.planner.pricing import MENU, Layout, Option, Outcome, SearchSettings, Solves, Units
from zbcompile.planner.report import search_text
from zbcompile.planner.search import SearchResult, menu, nearest_search, search, worth_recomputing
from zbcompile.planner.units import LEVEL_NAMES, compiled_units, model_units
from zbcompile.schedules.memory_limit import parse_bytes

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class LayoutPlan:
    """The search's answer: `result` (`search.SearchResult`) and its JSON-able `record`,
    which `str()` prints."""

    result: SearchResult
    record: dict[str, Any]

    @property
    def best(self) -> Outcome | None:
        return self.result.best

    def __str__(self) -> str:
        return search_text(self.record)


def plan_layouts(
    model: nn.Module, inputs: tuple, kwargs: dict, target: Any,
    *, gpus: int, gpus_per_node: int = 8, hardware: Hardware | str = "H100-80GB",
    memory_limit: float | str | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer_factor: float = 2.0, grad_factor: float = 1.0, tensor_parallel: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False, data_parallel: Sequence[str] = ("replicate", "shard"), keep: int = 5,
    near: Layout | None = None, solves: Solves | None = None, near_seconds: float = math.inf,
) -> LayoutPlan:
    """The `keep` fastest layouts of `model` over `gpus` GPUs (`gpus_per_node` to a node) for the
    global batch `inputs`, `kwargs`, `target` that fit `memory_limit` bytes per GPU (default:
    the device's memory); tp > 1 where the model has a tensor-parallel plan (`tensor_parallel`,
    or a transformers model's own) that splits it. With `near`, the record also names the
    fitting layouts closest to it (`search.nearest_search`, within `near_seconds`). `solves`: the
    plan's schedules made so far (`pricing.Solves`)."""
    units, settings, device, refused = _searched_units(
        model, inputs, kwargs, target, gpus, gpus_per_node, hardware, memory_limit, loss_fn, optimizer_factor,
        grad_factor, tensor_parallel, sequence_parallel, tuple(data_parallel), keep,
    )
    solves = solves or Solves()
    result = search(units, settings, solves=solves)
    result.peak_flops = device.flops
    result.dropped[:0] = [(f"tp={t}", why) for t, why in refused.items()]
    record = search_record(result, device)
    if near is not None:
        record.update(nearest_record(units, result, near, solves, near_seconds))
    return LayoutPlan(result, record)


def nearest_layouts(
    model: nn.Module, inputs: tuple, kwargs: dict, target: Any, near: Layout, *, gpus: int, gpus_per_node: int = 8,
    hardware: Hardware | str = "H100-80GB", memory_limit: float | str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None, optimizer_factor: float = 2.0, grad_factor: float = 1.0,
    tensor_parallel: Mapping[str, Any] | None = None, sequence_parallel: bool = False, solves: Solves | None = None,
    seconds: float = math.inf,
) -> dict[str, Any]:
    """`plan_layouts`' "near", "nearest" and "nearest_budget" for `near` without searching the
    fastest layouts (`search.nearest_search`, within `seconds`)."""
    units, settings, device, _ = _searched_units(
        model, inputs, kwargs, target, gpus, gpus_per_node, hardware, memory_limit, loss_fn, optimizer_factor,
        grad_factor, tensor_parallel, sequence_parallel, ("replicate", "shard"), 5,
    )
    result = SearchResult(settings, [], [], [], 0, 0, 0.0, units.flops_per_sample, units.tokens_per_sample,
                          device.flops)
    return nearest_record(units, result, near, solves or Solves(), seconds)


def _searched_units(
    model: nn.Module, inputs: tuple, kwargs: dict, target: Any, gpus: int, gpus_per_node: int,
    hardware: Hardware | str, memory_limit: float | str | None, loss_fn: Callable[..., torch.Tensor] | None,
    optimizer_factor: float, grad_factor: float, tensor_parallel: Mapping[str, Any] | None,
    sequence_parallel: bool, data_parallel: tuple[str, ...], keep: int,
) -> tuple[Any, SearchSettings, Hardware, dict[int, str]]:
    """The model's units compiled for the search (`units.model_units`), the search's settings, the
    hardware and the tp degrees refused, with why (`plan_layouts`' arguments)."""
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
        batch = (tuple(inputs), dict(kwargs), target)
        return pytree.tree_map(lambda x: x[:b] if isinstance(x, torch.Tensor) else x, batch)

    units = model_units(model, batch_of, device, tps, parallel_plan, sequence_parallel, loss_fn)
    settings = settings_on(
        device, gpus=gpus, global_batch=global_batch, memory_limit=limit, gpus_per_node=gpus_per_node,
        optimizer_factor=optimizer_factor, grad_factor=grad_factor, data_parallel=data_parallel, keep=keep,
    )
    return units, settings, device, refused


def settings_on(hardware: Hardware, **fields: Any) -> SearchSettings:
    """`SearchSettings` of `fields` whose messages and gradient reductions run on `hardware`'s links."""
    return SearchSettings(
        link_bandwidth=hardware.link_bandwidth,
        allreduce_seconds_per_byte=lambda dp: hardware.allreduce_seconds(1.0, dp), **fields,
    )


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
        if why := split_mismatch(model, plan, t) or (t > gpus_per_node and f"above the {gpus_per_node} GPUs of a node"):
            refused[t] = why
    return plan, refused


def outcome_record(result: SearchResult, outcome: Outcome) -> dict[str, Any]:
    """One layout's line: the layout, its option, step, rates, memory."""
    layout = outcome.layout
    return {
        "pp": layout.pp, "tp": layout.tp, "dp": layout.dp, "data_parallel": layout.data_parallel,
        "microbatch_size": layout.microbatch_size, "microbatches": layout.microbatches,
        "schedule": outcome.option.name, "recompute": recompute_name(outcome.option),
        "cut": outcome.option.cut, "step": outcome.step, "busy": outcome.busy,
        "peak_bytes": max(outcome.peaks), **step_rates(result, outcome),
    }


def search_record(result: SearchResult, hardware: Hardware) -> dict[str, Any]:
    """The JSON-able record `planner/report.search_text` prints."""
    s = result.settings
    reasons: dict[str, list[str]] = {}
    for what, why in result.dropped:
        reasons.setdefault(why, []).append(what)
    return {
        "gpus": s.gpus, "gpus_per_node": s.gpus_per_node, "global_batch": s.global_batch,
        "tokens_per_sample": result.tokens_per_sample, "hardware": hardware.name, "memory_limit_bytes": s.memory_limit,
        "seconds": result.seconds, "options": result.options, "priced": len(result.priced), "pruned": result.pruned,
        "layouts": [outcome_record(result, o) for o in result.ranked],
        "dropped": [{"why": why, "count": len(what), "examples": what[:2]} for why, what in reasons.items()],
    }


def nearest_record(
    units: Units, result: SearchResult, near: Layout, solves: Solves, seconds: float = math.inf
) -> dict[str, Any]:
    """"near", "nearest": the fitting layouts closest to `near` (`search.nearest_search`; rates on
    `result`'s model and hardware) and "nearest_budget": what `seconds` left unpriced."""
    found, budget = nearest_search(units, result.settings, near, solves=solves, seconds=seconds)
    return {"near": str(near), "nearest": [outcome_record(result, o) for o in found],
            "nearest_budget": {**budget, "seconds": None if budget["seconds"] == math.inf else budget["seconds"]}}


def menu_record(
    costed: CostedPipeline, hardware: Hardware, o: Any, limit: float, solves: Solves | None = None
) -> dict[str, Any]:
    """What a given layout's plan (`plan.plan`, its `PlanOptions` `o`) says of the menu:
    "menu" (`pricing.MENU`, each schedule without recomputation and, where `costed` has its
    recompute alternatives, with the fastest level that fits), "menu_choice", the fastest that
    fits (None: nothing does), "menu_binds": whether, without the alternatives, some recompute
    level would be priced (`search.worth_recomputing`), and with dp > 1 "other_mode": the
    fastest that fits keeping the state the other data-parallel way. `solves`: the plan's schedules
    made so far (`pricing.Solves`)."""
    solves = solves or Solves()
    stages = len(costed.costs)
    given = Layout(stages, o.tp, o.dp, o.data_parallel, 1, o.microbatches)
    settings = settings_on(
        hardware, gpus=stages * o.tp * o.dp, global_batch=o.microbatches * o.dp, memory_limit=limit,
        gpus_per_node=max(8, o.tp), optimizer_factor=o.optimizer_factor, grad_factor=o.grad_factor,
        time_budget=o.time_budget,
    )
    units = compiled_units(costed, hardware, o.tp, 1)
    entries = _menu_entries(menu(units, settings, given, solves=solves))
    fitting = [e for e in entries if e["fits"]]
    record = {
        "menu": entries, "menu_choice": min(fitting, key=lambda e: e["step"]) if fitting else None,
        "menu_binds": not costed.alternatives and worth_recomputing(units, settings, given, solves=solves),
    }
    if o.dp > 1:
        other = "shard" if o.data_parallel == "replicate" else "replicate"
        other_menu = menu(units, settings, replace(given, data_parallel=other), solves=solves, rows=False)
        fitting = [e for e in _menu_entries(other_menu) if e["fits"]]
        record["other_mode"] = {"data_parallel": other, **min(fitting, key=lambda e: e["step"])} if fitting else None
    return record


def recompute_name(option: Option) -> str:
    """An option's recomputation: a level's name, or per stage (runs of one level counted)."""
    if not option.stage_levels:
        return LEVEL_NAMES[option.level]
    runs: list[list] = []
    for level in option.stage_levels:
        if runs and runs[-1][0] == level:
            runs[-1][1] += 1
        else:
            runs.append([level, 1])
    return "per stage: " + "; ".join(f"{LEVEL_NAMES[level]} x{count}" for level, count in runs)


def _menu_entries(priced: list[Outcome]) -> list[dict[str, Any]]:
    """Per schedule of the menu: its price without recomputation, and its best with some (or on a
    recompute cut, which may recompute nothing)."""
    entries = []
    for name, placement in MENU:
        own = [p for p in priced if (p.option.schedule, p.option.placement) == (name, placement)]
        plain = [p for p in own if p.option.level == 0 and not p.option.stage_levels]
        recomputed = sorted((p for p in own if p.option.level or p.option.stage_levels),
                            key=lambda p: (not p.fits, p.step if p.fits else max(p.peaks or (math.inf,))))
        if recomputed and plain and recomputed[0].error and plain[0].error:
            recomputed = []  # no level helps: one line says why
        entries += [_menu_entry(p) for p in plain[:1] + recomputed[:1]]
    return entries


def _menu_entry(outcome: Outcome) -> dict[str, Any]:
    """A menu row; where the option was made, also its actions and per-stage (chunk) seconds (F, I,
    W, the message, each chunk's gradient reduction over the replicas), which `zbcompile rehearse
    plan.json` runs."""
    entry = {
        "schedule": outcome.option.name, "recompute": recompute_name(outcome.option), "step": outcome.step,
        "peak_bytes": max(outcome.peaks) if outcome.peaks else None, "peaks": list(outcome.peaks),
        "fits": outcome.fits, "error": outcome.error or None,
    }
    if outcome.made is not None:
        schedule, costs, cut = outcome.made
        entry["cut"] = {"placement": cut.placement, "positions": list(cut.positions)}
        entry["actions"] = schedule.compute_only().rows_as_text()
        entry["seconds"] = {
            "f": list(costs.f), "i": list(costs.i), "w": list(costs.w), "comm": costs.comm,
            "reduce": list(costs.reduce) or [0.0] * len(costs.f),  # each chunk's gradient reduction, after its last W
        }
    return entry


def step_rates(result: SearchResult, outcome: Outcome) -> dict[str, float]:
    """Samples and tokens per second of `outcome`, and its MFU on `result`'s peak FLOP/s."""
    samples = result.settings.global_batch / outcome.step
    flops = result.flops_per_sample * result.settings.global_batch
    mfu = flops / (result.settings.gpus * result.peak_flops * outcome.step) if result.peak_flops else math.nan
    return {"samples_per_s": samples, "tokens_per_s": samples * result.tokens_per_sample, "mfu": mfu}

