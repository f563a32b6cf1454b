"""Memory limits given in bytes ("12GiB", "800MB", or one such string per rank) turned into the
schedule's unit (one microbatch's activations of the largest stage, ``unit_bytes`` bytes: the
compiler's own M_B per stage). Numbers are already in that unit and pass through.

Where none is given, ``default_limit`` is the rule: no limit, except for a model with
checkpointed regions under a solved schedule of one stage per rank (zb-auto), which gets 1F1B's
peak on each rank (see there).

`state_bytes`: what one rank holds for its parameters (gradients, optimizer state) under each
data-parallel mode, which the runtime's report and the planner both price."""

from __future__ import annotations

import re
from typing import Sequence, Union

from .costs import Costs
from .ir import Schedule
from .registry import make_schedule, schedule_spec
from .simulate import simulate

DATA_PARALLEL_MODES = ("replicate", "shard")  # how data-parallel replicas keep their state

Limit = Union[None, float, str, Sequence[Union[float, str]]]

_SUFFIXES = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> float:
    """``"12GiB"`` -> 12 * 2**30; decimal (KB, MB, GB, TB) and binary (KiB ... TiB) suffixes, or
    none for plain bytes. ValueError naming the accepted forms otherwise."""
    match = _BYTES_RE.match(text) if isinstance(text, str) else None
    suffix = match.group(2).upper() if match else None
    if match is None or suffix not in _SUFFIXES:
        raise ValueError(
            f"memory_limit {text!r} is not a byte size; write a number with an optional suffix "
            "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. '12GiB'), or a number of microbatch activations"
        )
    value = float(match.group(1)) * _SUFFIXES[suffix]
    if value <= 0:
        raise ValueError(f"memory_limit {text!r} must be positive")
    return value


def is_bytes(limit: Limit) -> bool:
    """Whether ``limit`` is given in bytes (a string, or strings per rank)."""
    if isinstance(limit, str):
        return True
    return isinstance(limit, (list, tuple)) and any(isinstance(v, str) for v in limit)


def check_memory_limit(limit: Limit) -> None:
    """Raise ValueError for a malformed limit (byte strings are parsed)."""
    values = limit if isinstance(limit, (list, tuple)) else [limit]
    for value in values:
        if isinstance(value, str):
            parse_bytes(value)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"memory_limit entries must be numbers or byte sizes such as '12GiB', got {value!r}")


def in_schedule_units(limit: Limit, unit_bytes: float) -> float | list[float] | None:
    """``limit`` in units of ``unit_bytes`` (byte strings divided by it, numbers kept)."""
    if unit_bytes <= 0:
        raise ValueError(f"the memory unit must be a positive number of bytes, got {unit_bytes}")

    def one(value: float | str) -> float:
        return parse_bytes(value) / unit_bytes if isinstance(value, str) else float(value)

    if limit is None:
        return None
    if isinstance(limit, (list, tuple)):
        return [one(v) for v in limit]
    return one(limit)


def limit_in_words(limit: Limit, unit_bytes: float) -> str:
    """``limit`` and what it is in the schedule's unit, for error messages."""
    units = in_schedule_units(limit, unit_bytes)
    shown = [round(u, 3) for u in units] if isinstance(units, list) else round(units, 3)
    return (
        f"memory_limit {limit!r} is {shown} microbatch activations of the largest stage "
        f"({unit_bytes:g} bytes each, from the compiler's activation sizes)"
    )


DEFAULT_LIMIT_RULE = "none given, the model checkpoints: 1F1B's peak on each rank"


def default_limit(
    schedule: str | Schedule, stages: int, microbatches: int, costs: Costs, checkpointed: bool
) -> list[float] | None:
    """The limit (per rank, in the schedule's unit) a pipeline runs `schedule` under when it was
    given none. None (a solved schedule then uses all the memory it gains time with), except for a
    model with checkpointed regions (`checkpointed`) under a solved schedule of one stage per rank
    (zb-auto): the peak 1F1B holds on each rank on the same compile (simulated with the same
    `costs`). Checkpointing says memory matters: zb-auto then defers a W only where that memory
    allows (a rank whose W stash is small next to 1F1B's peak), instead of spending the memory
    checkpointing saved on pending W. 1F1B's own order fits by construction, so a schedule
    exists. Fixed schedules (1f1b, zb-h1, zb-h2, ...) and zbv (1F1B's memory already) are left
    as they are, and so is a given `Schedule`."""
    if isinstance(schedule, Schedule):
        return None
    spec = schedule_spec(schedule)
    if not checkpointed or not spec.solved or spec.chunks_per_rank != 1:
        return None
    return list(simulate(make_schedule("1f1b", stages, microbatches), costs).peak_memory)


def state_bytes(
    param_bytes: float, dp: int, mode: str, grad_factor: float = 1.0, optimizer_factor: float = 2.0
) -> dict[str, float]:
    """Bytes one rank holds for a stage's `param_bytes` (P) of parameters during a step: "params",
    "grads", "optimizer" and their "total". AdamW by default: two moments per parameter in its
    dtype (`optimizer_factor=2`), gradients in the parameters' dtype (`grad_factor=1`).

        replicate  parameters P, gradients P x grad_factor, optimizer state P x optimizer_factor
        shard      parameters, gradients and optimizer state stored divided over the dp ranks (a
                   DTensor shard each, as FSDP2 keeps them), plus the stage's whole parameters
                   gathered and its whole gradients accumulated while the step runs"""
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {mode!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    grads, optimizer = param_bytes * grad_factor, param_bytes * optimizer_factor
    if mode == "replicate":
        held = {"params": param_bytes, "grads": grads, "optimizer": optimizer}
    else:
        held = {"params": param_bytes + param_bytes / dp, "grads": grads + grads / dp, "optimizer": optimizer / dp}
    return {**held, "total": sum(held.values())}
