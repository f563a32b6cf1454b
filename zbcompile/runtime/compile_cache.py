"""Which compile serves a batch: one per shape, or one shape-generic compile for the dimensions
whose sizes vary (`pipeline(dynamic=...)`, `passes/shape_symbols.py`).

    dynamic=None (default)  the first compile is for the batch's shapes; a batch like an earlier
                            one but for the sizes of some dimensions compiles once more, with those
                            dimensions symbolic, and every later size of them runs on that compile
    dynamic=True            every dimension of every input and target tensor symbolic from the start
    dynamic=1 or (0, 1)     those dimensions (of every tensor that has them) symbolic from the start
    dynamic=False           one compile per shape

A compile serves a batch when the batch has its structure, dtypes, devices and sizes in every
dimension it did not make symbolic, and its trace's guards hold for the batch's sizes
(`ShapeSymbols.bind`). A dimension the trace could not keep symbolic (a guard on its size, or a
size the graph computes otherwise than by arithmetic) compiles per shape from then on, said once
in a warning that names the guard. Evaluation keeps its forward-only compiles the same way, in a
cache of its own per results, placement and mode.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Mapping

import torch

from zbcompile.schedules import simulate
from zbcompile.schedules.memory_limit import in_schedule_units, is_bytes

SHOWN_SIZES = 12  # explain() lists the steps of this many sizes at most
Dims = dict[str, tuple[int, ...]]  # by leaf name (`input_<i>`, `target_<i>`): the symbolic dimensions


class CompileCache:
    """The compiles of one pipeline by the key of a batch (`batch.split`) and what each serves."""

    def __init__(self, dynamic: Any, unsupported: str | None = None) -> None:
        self.dynamic = dynamic
        self.unsupported = unsupported  # why no compile here can be shape-generic (None: it can)
        self.builds: dict[Any, Any] = {}  # by the key of the batch each was compiled for
        self.served: dict[Any, Any] = {}  # a batch's key -> the key of the compile serving it
        self.seen: dict[Any, dict[str, torch.Size]] = {}  # a batch's key -> its microbatch's tensor shapes
        self.per_shape: set[tuple[str, int]] = set()  # dimensions a trace could not keep symbolic
        self.steps: dict[str, dict[str, int]] = {}  # the sizes of the steps run -> schedule -> steps

    def clear(self) -> None:
        self.builds.clear()
        self.served.clear()

    def ran(self, sizes: str, schedule: str) -> None:
        """A step ran at `sizes` (`sizes_text`) under `schedule`."""
        by_schedule = self.steps.setdefault(sizes, {})
        by_schedule[schedule] = by_schedule.get(schedule, 0) + 1

    def lines(self) -> list[str]:
        """For `explain()`: which dimensions a compile keeps symbolic, and the steps by size and schedule."""
        generic = [b.compiled.traced.symbols for b in self.builds.values() if b.compiled.traced.symbols is not None]
        if not generic:
            return []
        runs = [f"{sizes}: {s} x{n}" for sizes, by in self.steps.items() for s, n in by.items()]
        more = f" and {len(runs) - SHOWN_SIZES} more" if len(runs) > SHOWN_SIZES else ""
        runs = ", ".join(runs[:SHOWN_SIZES]) + more
        return [
            *(f"symbolic sizes: {symbols.describe()}, one compile for every size its guards allow" for symbols in
              generic),
            f"{len(self.builds)} compiles; steps by size and schedule: {runs}",
        ]

    def shape_generic(self) -> bool:
        """Whether a compile here serves sizes it was not traced with."""
        return any(built.compiled.traced.symbols is not None for built in self.builds.values())

    def serving(self, key: Any, leaves: Mapping[str, torch.Tensor]) -> Any | None:
        """The key of the compile that serves a batch of `key` whose first microbatch's tensors
        are `leaves` (by leaf name), or None where none does."""
        if key in self.served and self.served[key] in self.builds:
            return self.served[key]
        self.seen.setdefault(key, {name: t.shape for name, t in leaves.items()})
        for built_key, built in self.builds.items():
            symbols = built.compiled.traced.symbols
            if symbols is None or _structure(built_key) != _structure(key):
                continue
            if _static_sizes(self.seen[built_key], symbols) != _static_sizes(self.seen[key], symbols):
                continue
            if symbols.bind(leaves) is not None:
                self.served[key] = built_key
                return built_key
        return None

    def symbolic_dims(self, key: Any, leaves: Mapping[str, torch.Tensor]) -> Dims | None:
        """The dimensions a new compile for `key` makes symbolic (None: none, a compile for this shape)."""
        if self.dynamic is False:
            return None
        if self.dynamic is True:
            dims = {name: tuple(range(t.dim())) for name, t in leaves.items()}
        elif self.dynamic is not None:
            wanted = (self.dynamic,) if isinstance(self.dynamic, int) else tuple(self.dynamic)
            dims = {name: tuple(d for d in wanted if d < t.dim()) for name, t in leaves.items()}
        else:
            dims = self._varying(key, leaves)
        dims = {n: tuple(d for d in ds if (n, d) not in self.per_shape) for n, ds in dims.items()}
        dims = {n: ds for n, ds in dims.items() if ds}
        if dims and self.unsupported is not None:
            self.compiles_per_shape([(n, d) for n, ds in dims.items() for d in ds], self.unsupported)
            return None
        return dims or None

    def _varying(self, key: Any, leaves: Mapping[str, torch.Tensor]) -> Dims:
        """Automatic: the dimensions whose size differs from an earlier batch of this structure,
        and those an earlier shape-generic compile of it made symbolic."""
        dims: dict[str, set[int]] = {}
        for other_key, shapes in self.seen.items():
            if other_key == key or _structure(other_key) != _structure(key):
                continue
            for name, tensor in leaves.items():
                before = shapes.get(name)
                if before is not None and len(before) == tensor.dim():
                    dims.setdefault(name, set()).update(d for d in range(tensor.dim()) if before[d] != tensor.shape[d])
        for built_key, built in self.builds.items():
            symbols = built.compiled.traced.symbols
            if symbols is not None and _structure(built_key) == _structure(key):
                for d in symbols.dims:
                    dims.setdefault(d.leaf, set()).add(d.dim)
        return {name: tuple(sorted(ds)) for name, ds in dims.items()}

    def add(self, key: Any, built: Any, dims: Dims | None) -> None:
        """Keep `built`, the compile for `key` (made with `dims` symbolic); a dimension it asked
        to be symbolic and the trace specialised compiles per shape from now on (said once)."""
        self.builds[key] = built
        self.served[key] = key
        symbols = built.compiled.traced.symbols
        if symbols is None:  # asked for none, or the compile fell back to this shape (and said so)
            return
        kept = {(d.leaf, d.dim) for d in symbols.symbolic()}
        fixed = [(n, d) for n, ds in (dims or {}).items() for d in ds if (n, d) not in kept]
        if fixed:
            self.compiles_per_shape(fixed, f"the trace fixes it: {symbols.describe()}")

    def compiles_per_shape(self, dims: list[tuple[str, int]], why: str) -> None:
        """From now on, `dims` compile per shape; the first time, a warning says why."""
        if not self.per_shape:
            shown = ", ".join(f"{leaf}[{dim}]" for leaf, dim in dims)
            warnings.warn(
                f"zbcompile: {shown} cannot be symbolic in one compile for every size ({why}); each new size of "
                "it compiles the model again. Pass dynamic=False to pipeline() to compile per shape without trying",
                stacklevel=4,
            )
        self.per_shape.update(dims)

    def compile(self, key: Any, leaves: Mapping[str, torch.Tensor], make: Callable[[Dims | None], Any]) -> Any:
        """A new compile for `key` by `make(dims)`, shape-generic where `symbolic_dims` says so
        (`make` compiles for this shape where that fails, saying so through `compiles_per_shape`)."""
        dims = self.symbolic_dims(key, leaves)
        built = make(dims)
        self.add(key, built, dims)
        return built


    def compile_or_fall_back(self, dims: Dims | None, compile: Callable[[Dims | None], Any]) -> Any:
        """`compile(dims)`; where that fails with dimensions to make symbolic, `compile(None)` for
        this shape, the reason said once (`compiles_per_shape`)."""
        if dims is None:
            return compile(None)
        try:
            return compile(dims)
        except Exception as error:  # noqa: BLE001 - compiled for this shape instead (a user's error recurs there)
            self.compiles_per_shape([(n, d) for n, ds in dims.items() for d in ds], first_line(error))
            return compile(None)


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def _structure(key: Any) -> Any:
    """A batch key without its tensors' shapes: its pytree specs and each leaf's dtype, device
    and number of dimensions (a constant as it is)."""
    spec, target_spec, described = key
    return spec, target_spec, tuple(
        ("tensor", len(leaf[1]), *leaf[2:]) if isinstance(leaf, tuple) and leaf[:1] == ("tensor",) else leaf
        for leaf in described
    )


def _static_sizes(shapes: Mapping[str, torch.Size], symbols: Any) -> dict[str, tuple]:
    """Each tensor's sizes with the symbolic dimensions of `symbols` left out."""
    symbolic = {(d.leaf, d.dim) for d in symbols.dims}
    return {n: tuple(s if (n, d) not in symbolic else None for d, s in enumerate(shape)) for n, shape in shapes.items()}


def step_label(schedule: Any) -> str:
    """A schedule as `explain()`'s steps by size name it (one solved for longer sizes' memory says so)."""
    power = schedule.info.get("memory_scale")
    return schedule.name if power is None else f"{schedule.name} (fits {power:g}x the activations)"


def sizes_text(values: Mapping[Any, int] | None, leaves: Mapping[str, torch.Tensor]) -> str:
    """A batch's sizes as a shape-generic compile sees them (`values`, `s0=48`), or its tensors' shapes."""
    if values:
        return " ".join(f"{symbol}={value}" for symbol, value in values.items())
    return " ".join(f"{name}{list(t.shape)}" for name, t in leaves.items())


def fitting_schedule(
    compiled: Any, running: Any, values: Mapping[Any, int], limit: Any, solved: dict[float, Any],
    solve: Callable[[Any], Any],
) -> Any | None:
    """For a step at symbol `values` of a shape-generic compile under a memory `limit` in bytes:
    None where the `running` schedule's peak activation memory fits the limit at these sizes;
    else a schedule solved under the limit with each microbatch's memory the next power of 2^(1/4)
    of these sizes' (`CompiledPipeline.memory_scale`), kept in `solved` by that power (`solve(costs)`:
    the pipeline's solve with these costs, on one rank for all). A length at which nothing fits
    is a ValueError that says so."""
    if limit is None or not is_bytes(limit):  # a limit in microbatches' activations holds at every size
        return None
    scale = compiled.memory_scale(values)
    if scale <= 1:
        return None
    static = compiled.schedule_costs()
    peaks = simulate(running, static).peak_memory
    allowed = in_schedule_units(limit, compiled.memory_unit())
    allowed = allowed if isinstance(allowed, list) else [allowed] * len(peaks)
    if all(peak * scale <= room for peak, room in zip(peaks, allowed)):
        return None
    power = round(2 ** (math.ceil(4 * math.log2(scale)) / 4), 3)  # steps of 2^(1/4): 19% more memory each
    if power not in solved:
        scaled = dataclasses.replace(
            static, mem_b=[m * power for m in static.mem_b], mem_w=[m * power for m in static.mem_w]
        )
        try:
            solved[power] = solve(scaled).with_info(memory_scale=power)
        except ValueError as error:
            raise ValueError(
                f"at sizes {', '.join(f'{s}={v}' for s, v in values.items())} a microbatch keeps {scale:.2f}x the "
                f"activations of the compile's example, and no schedule fits memory_limit={limit!r} there ({error}); "
                "pass a larger limit or shorter sequences"
            ) from error
    return solved[power]
