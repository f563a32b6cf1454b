"""A hardware profile as data: what the planner (`zbcompile.plan`) turns FLOPs and bytes into seconds with.

    Hardware(flops=989e12, memory_bandwidth=3.35e12, link_bandwidth=50e9, memory=80e9, efficiency=0.4)
    Hardware.named("H100-80GB"), Hardware.load("my_gpu.json"), Hardware.from_measured(costs, static)

A pass (F, I or W of a stage) with `flops` FLOPs that writes `written_bytes` bytes takes

    (flops / peak flops + written_bytes / memory_bandwidth) / efficiency(pass)

seconds, a roofline sum: matmuls at the compute peak, elementwise work at the bandwidth, both at
the share of peak a training run achieves (`efficiency`, one factor, or one per pass kind
in `pass_efficiency` as `from_measured` fits them). A message of n bytes between pipeline
neighbours takes n / link_bandwidth seconds; a tensor-parallel collective inside a node runs at
`intra_node_bandwidth` (NVLink), a ring all-reduce of n bytes over r ranks moving 2 (r - 1) / r n
bytes over each rank's link, an all-gather or a reduce-scatter half that. Pure Python: no torch.

The named profiles take their peaks from the vendors' public specifications (SXM parts, dense
bf16 Tensor Core FLOP/s, HBM bandwidth, memory in decimal GB) and `link_bandwidth` from one
InfiniBand port per GPU (pipeline neighbours usually sit on different nodes: HDR 200 Gb/s for
A100 systems, NDR 400 Gb/s for H100/H200 systems) and `intra_node_bandwidth` from NVLink, one
direction of its total (A100: 600 GB/s, H100 and H200: 900 GB/s). `efficiency` 0.4 is a typical large-model
training MFU; calibrate it with `from_measured` for your own numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol, Sequence

PASS_KINDS = ("F", "I", "W")


class PassCost(Protocol):
    """What the compiler's `graph_cost.GraphCost` gives: FLOPs and bytes written of one pass."""

    flops: int
    written_bytes: int


@dataclass(frozen=True)
class Hardware:
    """One accelerator: peak FLOP/s (`flops`), memory bandwidth and pipeline link bandwidth
    (bytes/s), device `memory` (bytes), and the share of peak training achieves (`efficiency`;
    `pass_efficiency` overrides it per pass kind "F", "I", "W"). `name` labels reports."""

    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    memory: float
    efficiency: float = 0.4
    pass_efficiency: Mapping[str, float] = field(default_factory=dict)
    name: str = "custom"
    intra_node_bandwidth: float | None = None  # bytes/s between GPUs of a node (NVLink); None: link_bandwidth

    def __post_init__(self) -> None:
        for label in ("flops", "memory_bandwidth", "link_bandwidth", "memory"):
            _check_positive(f"Hardware {label}", getattr(self, label))
        if self.intra_node_bandwidth is not None:
            _check_positive("Hardware intra_node_bandwidth", self.intra_node_bandwidth)
        for kind, value in [("efficiency", self.efficiency), *self.pass_efficiency.items()]:
            if kind not in ("efficiency", *PASS_KINDS):
                raise ValueError(f"Hardware pass_efficiency keys are {PASS_KINDS}, got {kind!r}")
            _check_positive(f"Hardware {kind} efficiency", value)
            if value > 1:
                raise ValueError(f"Hardware {kind} efficiency is a share of peak (0, 1], got {value}")

    def efficiency_of(self, kind: str) -> float:
        """The share of peak a pass of `kind` ("F", "I", "W") achieves."""
        return self.pass_efficiency.get(kind, self.efficiency)

    def roofline_seconds(self, cost: PassCost) -> float:
        """Seconds of a pass at the peaks (efficiency 1): FLOPs at `flops`, written bytes at `memory_bandwidth`."""
        return cost.flops / self.flops + cost.written_bytes / self.memory_bandwidth

    def pass_seconds(self, cost: PassCost, kind: str) -> float:
        """Predicted seconds of one pass (F, I or W) of one microbatch."""
        return self.roofline_seconds(cost) / self.efficiency_of(kind)

    def link_seconds(self, nbytes: float) -> float:
        """Seconds to send `nbytes` to a pipeline neighbour."""
        return nbytes / self.link_bandwidth

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce of `nbytes` over `ranks` ranks: 2 (ranks - 1) / ranks of it crosses each link."""
        return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / self.link_bandwidth

    def intra_node_seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """A collective among the GPUs of a node (tensor parallelism's): "all_reduce" of `nbytes`
        (a ring: 2 (ranks - 1) / ranks of it over each rank's link), or "all_gather" (a
        reduce-scatter the same) of a result of `nbytes`, half that."""
        if ranks <= 1:
            return 0.0
        bandwidth = self.intra_node_bandwidth or self.link_bandwidth
        return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks * nbytes / bandwidth

    # --- from and to data --------------------------------------------------------------------

    @classmethod
    def named(cls, name: str) -> "Hardware":
        """A well-known accelerator by name (`NAMED`); ValueError naming the choices otherwise."""
        if name not in NAMED:
            raise ValueError(
                f"unknown hardware {name!r}; choose one of {', '.join(NAMED)}, or pass a Hardware or a JSON file"
            )
        return NAMED[name]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Hardware":
        """From `to_dict()`'s form; TypeError naming unknown or missing keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise TypeError(f"Hardware: unknown keys {sorted(unknown)}; the keys are {sorted(known)}")
        missing = {"flops", "memory_bandwidth", "link_bandwidth", "memory"} - set(data)
        if missing:
            raise TypeError(f"Hardware: missing keys {sorted(missing)}")
        values = dict(data)
        values["pass_efficiency"] = dict(values.get("pass_efficiency") or {})
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pass_efficiency": dict(self.pass_efficiency)}

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Hardware":
        """From a JSON file holding `to_dict()`'s keys."""
        with open(path) as file:
            return cls.from_dict(json.load(file))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as file:
            json.dump(self.to_dict(), file, indent=2)
            file.write("\n")

    @classmethod
    def from_measured(
        cls, measured: Any, static: Sequence[Mapping[str, PassCost]], like: "Hardware | str" = "H100-80GB",
        boundary_bytes: Sequence[float] = (),
    ) -> "Hardware":
        """`like` calibrated to measured per-pass times: `measured` has per-stage seconds `f`, `i`,
        `w` and `comm` (a `schedules.Costs`, e.g. `pipe.measured_costs` after `profile=True`
        steps; scalars stand for every stage), `static` each stage's pass costs by kind ("F", "I",
        "W": the compiler's `GraphCost`s). Per kind, the efficiency is the least-squares fit of
        measured = roofline / efficiency over the stages; with `boundary_bytes` (bytes each
        boundary sends), the link bandwidth is their mean over the measured `comm`."""
        base = resolve_hardware(like)
        stages = len(static)
        if stages == 0:
            raise ValueError("Hardware.from_measured needs the static costs of at least one stage")
        fitted = {}
        for kind, times in zip(PASS_KINDS, (measured.f, measured.i, measured.w)):
            seconds = _per_stage(times, stages, kind)
            roofline = [base.roofline_seconds(stage[kind]) for stage in static]
            scale = sum(x * t for x, t in zip(roofline, seconds))
            if scale <= 0:
                raise ValueError(
                    f"Hardware.from_measured: no measured time or no work for pass {kind}; cannot calibrate it"
                )
            fitted[kind] = min(1.0, sum(x * x for x in roofline) / scale)
        link = base.link_bandwidth
        sent = [b for b in boundary_bytes if b > 0]
        if sent and measured.comm > 0:
            link = sum(sent) / len(sent) / measured.comm
        return dataclasses.replace(base, link_bandwidth=link, pass_efficiency=fitted, name=f"{base.name} (calibrated)")


def resolve_hardware(hardware: "Hardware | str | os.PathLike") -> Hardware:
    """A `Hardware` as it is, a name from `NAMED`, or the path of a JSON file."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware in NAMED:
        return NAMED[hardware]
    if isinstance(hardware, (str, os.PathLike)) and os.path.exists(hardware):
        return Hardware.load(hardware)
    if isinstance(hardware, str):
        return Hardware.named(hardware)
    raise TypeError(
        f"hardware must be a Hardware, a name ({', '.join(NAMED)}) or a JSON file, got {type(hardware).__name__}"
    )


def resolve_rank_hardware(hardware: Any, ranks: int) -> tuple[Hardware, ...]:
    """One `Hardware` per pipeline rank: `hardware` as `resolve_hardware` takes it (every rank
    alike), or a list of such, one per rank (ranks of different kinds: a slower GPU, a shared
    node). ValueError where the list's length is not `ranks`."""
    if isinstance(hardware, (list, tuple)):
        if len(hardware) != ranks:
            raise ValueError(
                f"hardware lists {len(hardware)} profiles for {ranks} pipeline ranks; give one per rank (stage), "
                "or one for all"
            )
        return tuple(resolve_hardware(h) for h in hardware)
    return (resolve_hardware(hardware),) * ranks


def _check_positive(label: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{label} must be a positive finite number, got {value!r}")


def _per_stage(value: Any, stages: int, kind: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    values = [float(v) for v in value]
    if len(values) != stages:
        raise ValueError(f"measured {kind} times: {len(values)} values for {stages} stages")
    return values


NAMED: Mapping[str, Hardware] = MappingProxyType({
    "A100-80GB": Hardware(
        flops=312e12, memory_bandwidth=2.039e12, link_bandwidth=25e9, memory=80e9, name="A100-80GB",
        intra_node_bandwidth=300e9,
    ),
    "H100-80GB": Hardware(
        flops=989e12, memory_bandwidth=3.35e12, link_bandwidth=50e9, memory=80e9, name="H100-80GB",
        intra_node_bandwidth=450e9,
    ),
    "H200": Hardware(
        flops=989e12, memory_bandwidth=4.8e12, link_bandwidth=50e9, memory=141e9, name="H200",
        intra_node_bandwidth=450e9,
    ),
})
