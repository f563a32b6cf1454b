"""A model's costs per position, compiled once for every layout the planner's search weighs
(`planner/search.py`): one trace per microbatch size, three compiles in all.

`ModelUnits.units(tp, b)` is the model as the cut decision sees it (`schedules/cut_units.CutUnits`:
per position its F, I and W seconds on the hardware, its M_B, M_W and transient bytes, the bytes a
boundary there sends, each parameter's bytes on one tp rank) at each recompute level (index 0:
none, then `passes/recompute.RECOMPUTE_LEVELS`), for `tp` ranks per stage and `b` samples per
microbatch. Compiled (`compiler.compile_costs`): tp = 1 at b = 2 with every recompute level, the
widest tp asked at b = 2, tp = 1 at b = 4 (not b = 1, whose trace may differ by a squeezed
dimension). Derived, per position:

- another tp: a node's FLOPs and bytes are either whole or 1/tp of it on one rank (the plan's
  shares, `passes/tensor_parallel_shares.py`), so every quantity is x + y / tp, x and y from tp = 1
  and the widest; the collectives' seconds, (tp - 1) / tp of their bytes over the node's bandwidth,
  from the widest's. Exact for F and for I + W; which weight gradients wait for W (chosen by their
  arithmetic intensity, `split_backward`) and so M_B and M_W are the compiled tps' blend;
- another b: every quantity is affine in b (a pass's FLOPs and activations grow with it, a weight
  gradient's bytes and the parameters do not): its value at b = 2 times (c + (1 - c) b / 2), where
  c, the share that does not grow, is tp = 1's from its compiles at b = 2 and 4; the collectives
  grow with b;
- a recompute level at another tp or b: tp = 1's level-L value over its level 0 (times by the
  position's total time, memory by kind) times the position's level 0 at that tp and b.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from zbcompile.compiler import CostedPipeline, compile_costs
from zbcompile.passes import cut_profile
from zbcompile.passes.cut_positions import anchored_nodes
from zbcompile.passes.recompute import RECOMPUTE_LEVELS
from zbcompile.passes.tensor_parallel_shares import annotate_shares
from zbcompile.passes.trace import trace_model
from zbcompile.planner.cut import pass_timer
from zbcompile.planner.hardware import Hardware
from zbcompile.schedules.cut_units import CutUnits

LEVEL_NAMES = ("none", *(level.name for level in RECOMPUTE_LEVELS))
TRACED = (2, 4)  # the microbatch sizes compiled
COMPILE_STAGES = 4  # stages of the compiles the units come from (any count gives the same positions)

# (b) -> one microbatch of b samples: (args, kwargs, target)
BatchOf = Callable[[int], tuple[tuple, dict, Any]]


@dataclass
class ModelUnits:
    """Per-position costs of one model on one `hardware`, for any tp among `tps` and any
    microbatch size (module docstring). `flops_per_sample`: F + I + W FLOPs of one sample
    (tp = 1, no recomputation: what MFU counts); `tokens_per_sample`: the first input's length
    where it is a batch of token ids (else 1)."""

    hardware: Hardware
    tps: tuple[int, ...]
    flops_per_sample: float
    tokens_per_sample: int
    _base: tuple[CutUnits, ...]  # tp = 1, b = TRACED[0], per level
    _fixed: tuple[Any, ...]  # per quantity of _QUANTITIES and position: the share not growing with b
    _widest: tuple[int, CutUnits] | None = None  # the widest tp and its level 0 at TRACED[0], no collectives
    _collectives: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # F and I seconds per position there
    _cache: dict[tuple[int, int], tuple[CutUnits, ...]] = field(default_factory=dict)

    def units(self, tp: int, microbatch_size: int) -> tuple[CutUnits, ...]:
        """The model's `CutUnits` per recompute level (`LEVEL_NAMES`) at `tp` and `microbatch_size`;
        one rank's times (`for_ranks` gives a pipeline's)."""
        key = (tp, microbatch_size)
        if key not in self._cache:
            if tp not in self.tps:
                raise ValueError(f"ModelUnits: tp={tp} was not asked for; asked: {self.tps}")
            level0 = _grown(self._at_tp(tp), self._fixed, microbatch_size)
            if tp > 1:
                widest = self._widest[0]  # a collective's seconds grow as (tp - 1) / tp, and with b
                scale = (tp - 1) / tp * widest / (widest - 1) * microbatch_size / TRACED[0]
                level0 = _plus_collectives(level0, self._collectives, scale)
            self._cache[key] = tuple(
                level0 if level == 0 else _relative(level0, self._base[0], units)
                for level, units in enumerate(self._base)
            )
        return self._cache[key]

    def _at_tp(self, tp: int) -> CutUnits:
        """Level 0 at `TRACED[0]` samples on one of `tp` ranks, without collectives: x + y / tp,
        through tp = 1 and the widest tp compiled."""
        whole = self._base[0]
        if tp == 1:
            return whole
        widest, narrow = self._widest

        def at(one: Sequence[float], wide: Sequence[float]) -> tuple[float, ...]:
            # y = (x1 - xT) T / (T - 1), x = x1 - y
            return tuple(max(0.0, a - (a - b) * widest / (widest - 1) * (1 - 1 / tp)) for a, b in zip(one, wide))

        vectors = [at(a, b) for a, b in zip(_vectors(whole), _vectors(narrow))]
        params = tuple((at((a,), (b,))[0], readers) for (a, readers), (b, _) in zip(whole.params, narrow.params))
        return replace(_with_vectors(whole, vectors), params=params)


def for_ranks(units: CutUnits, ranks: int) -> CutUnits:
    """`units` whose first rank's times stand for `ranks` ranks of one kind."""
    return replace(units, times=units.times[:1] * ranks)


def model_units(
    model: nn.Module, batch_of: BatchOf, hardware: Hardware, tps: Sequence[int] = (1,),
    tensor_parallel: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> ModelUnits:
    """Compile `model` (meta device welcome) for the search (module docstring): one microbatch of
    `batch_of(b)` for b in `TRACED`, tp > 1 under the plan `tensor_parallel` (needed where `tps`
    has a tp > 1)."""
    once, twice = TRACED
    widest = max(tps)
    units: dict[tuple[int, int], Any] = {}
    for b in TRACED:
        args, kwargs, target = batch_of(b)
        traced = trace_model(model, loss_fn, args, kwargs, target, torch.device("cpu"), record_stack_traces=False)
        stages = min(COMPILE_STAGES, len(anchored_nodes(traced.graph_module.graph)))
        for tp in (1, widest) if b == once and widest > 1 else (1,):
            annotate = None
            if tp > 1:  # annotates the trace's nodes: every unit of tp = 1 is taken before
                annotate = lambda t, tp=tp: annotate_shares(t, tensor_parallel, tp, sequence_parallel)  # noqa: E731
            costed = compile_costs(
                model, loss_fn, args, kwargs, target, stages, traced=traced, annotate=annotate,
                recompute_alternatives=(tp, b) == (1, once),
            )
            levels = len(LEVEL_NAMES) if costed.alternatives else 1
            units[(tp, b)] = [_costed_units(costed, hardware, level) for level in range(levels)]
            if tp > 1:
                units["collectives"] = _collective_seconds(costed, hardware)
            if (tp, b) == (1, once):
                flops = sum(c.forward.flops + c.input_backward.flops + c.weight_backward.flops for c in costed.costs)
    base = tuple(units[(1, once)])
    first = next((a for a in batch_of(once)[0] if isinstance(a, torch.Tensor)), None)
    tokens = int(first.shape[1]) if first is not None and first.dim() == 2 and not first.is_floating_point() else 1
    found = ModelUnits(hardware, tuple(tps), float(flops) / once, tokens, base,
                       _fixed_shares(base[0], units[(1, twice)][0]))
    if widest > 1:
        found._widest, found._collectives = (widest, units[(widest, once)][0]), units["collectives"]
    return found


def _costed_units(costed: CostedPipeline, hardware: Hardware, level: int = 0) -> CutUnits:
    """`costed`'s CutUnits timed on `hardware` at recompute `level` (its tensor-parallel shares in
    the FLOPs, bytes and parameters; its collectives apart: `_collective_seconds`)."""
    layout = cut_profile.cut_layout(costed.traced, costed.partition)
    programs = costed.programs
    if level:
        programs = tuple(
            options[level] if options else program for options, program in zip(costed.alternatives, programs)
        )
    units = cut_profile.static_units(layout, programs, [pass_timer(hardware)], costed.representative)
    shares = costed.annotation
    if shares is None:
        return units
    params = tuple((nbytes * shares.param_shares.get(fqn, 1.0), readers)
                   for (fqn, _, _), (nbytes, readers) in zip(layout.params, units.params))
    return replace(units, params=params)


def _collective_seconds(costed: CostedPipeline, hardware: Hardware) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per position, the seconds of `costed`'s tensor-parallel collectives in F and in I."""
    shares = costed.annotation
    anchors = anchored_nodes(costed.traced.graph_module.graph)
    index = {node.name: p for p, node in enumerate(anchors)}
    seconds = ([0.0] * len(anchors), [0.0] * len(anchors))
    for kind, by_node in enumerate((shares.forward_collectives, shares.input_collectives)):
        for name, collectives in by_node.items():
            seconds[kind][index[name]] += sum(hardware.intra_node_seconds(c, n, shares.tp) for c, n in collectives)
    return tuple(seconds[0]), tuple(seconds[1])


_QUANTITIES = ("f", "i", "w", "mem_b", "mem_w", "crossing", "transient")


def _vectors(units: CutUnits) -> list[Sequence[float]]:
    f, i, w = units.times[0]
    return [f, i, w, units.mem_b, units.mem_w, units.crossing, units.transient or (0.0,) * units.positions]


def _with_vectors(units: CutUnits, vectors: Sequence[Sequence[float]]) -> CutUnits:
    """`units` with the quantities of `_QUANTITIES` taken from `vectors`, in that order (one rank's times)."""
    f, i, w, mem_b, mem_w, crossing, transient = vectors
    return replace(units, times=((f, i, w),), mem_b=mem_b, mem_w=mem_w, crossing=crossing, transient=transient)


def _plus_collectives(units: CutUnits, collectives: Sequence[Sequence[float]], scale: float = 1.0) -> CutUnits:
    """`units` (one rank's times) with `scale` x each position's collective seconds added to its F and I."""
    f, i, w = units.times[0]
    f, i = (tuple(t + scale * c for t, c in zip(times, seconds)) for times, seconds in zip((f, i), collectives))
    return replace(units, times=((f, i, w),))


def _fixed_shares(once: CutUnits, twice: CutUnits) -> tuple[tuple[float, ...], ...]:
    """Per quantity (`_QUANTITIES`) and position, the share of its value at `TRACED[0]` samples
    that does not grow with them: (2 x1 - x2) / x1 (x2 at twice as many). Unbounded: a
    position's share of its unit's work (`cut_profile.spread`) may shift with the samples, and
    the units' sums stay exact."""
    if once.positions != twice.positions:
        raise ValueError(
            f"the model traces to {once.positions} positions with {TRACED[0]} samples per microbatch and to "
            f"{twice.positions} with {TRACED[1]}; the planner's search needs one graph for every microbatch size"
        )
    return tuple(
        tuple((2 * a - b) / a if a > 0 else 1.0 for a, b in zip(x1, x2))
        for x1, x2 in zip(_vectors(once), _vectors(twice))
    )


def _grown(units: CutUnits, fixed: Sequence[Sequence[float]], b: int) -> CutUnits:
    """`units` (at `TRACED[0]` samples) at `b` samples per microbatch (module docstring)."""
    grown = [
        tuple(max(0.0, x * (c + (1 - c) * b / TRACED[0])) for x, c in zip(values, shares))
        for values, shares in zip(_vectors(units), fixed)
    ]
    return _with_vectors(units, grown)


def _relative(level0: CutUnits, base0: CutUnits, base_level: CutUnits) -> CutUnits:
    """`level0` (level 0 at some tp and b) at the recompute level `base_level` is of `base0`
    (both tp = 1, b = `TRACED[0]`): per position, times scaled by the position's total, memory by kind."""
    def total(units: CutUnits, p: int) -> float:
        return sum(kind[p] for kind in units.times[0])

    scale = [total(level0, p) / total(base0, p) if total(base0, p) > 0 else 1.0 for p in range(level0.positions)]
    times = tuple(tuple(x * s for x, s in zip(kind, scale)) for kind in base_level.times[0])

    def ratio(name: str) -> tuple[float, ...]:
        now, base, at_level = (dict(zip(_QUANTITIES, _vectors(u)))[name] for u in (level0, base0, base_level))
        return tuple(n * lv / b if b > 0 else lv for n, b, lv in zip(now, base, at_level))

    return replace(level0, times=(times,), mem_b=ratio("mem_b"), mem_w=ratio("mem_w"), transient=ratio("transient"))


@dataclass
class CompiledUnits:
    """One compile's units (`compiler.compile_costs` with its recompute alternatives) for the
    one tp and microbatch size it was compiled at: the menu of a given layout (`planner/plan.py`)."""

    tp: int
    microbatch_size: int
    levels: tuple[CutUnits, ...]
    flops_per_sample: float = 0.0
    tokens_per_sample: int = 1

    @property
    def tps(self) -> tuple[int, ...]:
        return (self.tp,)

    def units(self, tp: int, microbatch_size: int) -> tuple[CutUnits, ...]:
        if (tp, microbatch_size) != (self.tp, self.microbatch_size):
            raise ValueError(f"CompiledUnits: compiled at tp={self.tp}, microbatch size {self.microbatch_size} only")
        return self.levels


def compiled_units(costed: CostedPipeline, hardware: Hardware, tp: int, microbatch_size: int) -> CompiledUnits:
    """`costed`'s units at every recompute level it was compiled with, timed on `hardware`."""
    levels = [_costed_units(costed, hardware, level) for level in range(len(LEVEL_NAMES) if costed.alternatives else 1)]
    if costed.annotation is not None:
        collectives = _collective_seconds(costed, hardware)
        levels = [_plus_collectives(u, collectives) for u in levels]
    return CompiledUnits(tp, microbatch_size, tuple(levels))
