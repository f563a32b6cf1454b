"""Checkpoints of a pipelined training run on torch.distributed.checkpoint (DCP).

    zbcompile.checkpoint.save(f"ckpt/step_{pipe.step_count:06d}", pipe, opt, data_position=i)
    path = zbcompile.checkpoint.latest("ckpt")        # newest complete checkpoint, or None
    extra = zbcompile.checkpoint.load(path, pipe, opt)  # {"data_position": i}

Every rank of the pipelines writes its own part in parallel (DCP: no gather on one rank; an
entry held by several ranks, a tied weight or a data-parallel replica's copy, is written once).
What a checkpoint holds, under DCP's flattened keys:

- `model.<fqn>`: the model's state dict under the model's own FQNs (each rank: `pipe.state_dict()`);
- `optimizer.state.<fqn>.<name>`, `optimizer.param_groups.<fqn>.<name>`: the optimizer's state
  and hyperparameters per parameter FQN, as `torch.distributed.checkpoint.state_dict` flattens
  them (`flatten_optimizer_state_dict`), so that they load on any cut of the model;
- `step`: `pipe.step_count`;
- `rank<r>`: what only rank r can restore (`RankRecord`): its RNG states, the user's `extra`,
  a wrapped optimizer's step history, the schedule in use and its measured costs.

A post-validated optimizer's pending step is validated before saving (`finish()`, what the next
`pipe.step()` would do first), so the checkpoint holds final state and resuming gives the same
bits. Loading reads from the checkpoint what this rank holds, whatever the layout it was saved
on (one process, another schedule or cut, more or fewer ranks: DCP reads each rank's entries
wherever they were written, and would reshard DTensor entries the same way). The RNG states,
the schedule in use and its costs are restored where they apply: a rank's RNG states where the
checkpoint has that rank, the schedule where the pipeline runs the same schedule option on the
same cut and ranks (so dropout draws, measured costs and the schedule do not change the bits of
a resumed run).

A checkpoint is complete once its directory bears its final name: every rank writes into
`<path>.partial`; after DCP has written every part and its metadata (DCP writes `.metadata`
last), the first rank adds `zbcompile.json` and renames the directory atomically. `latest()`
takes only directories with both files and no temporary suffix, so a checkpoint interrupted
while being written (a rank killed, a full disk) is never taken as the latest.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh

MARKER = "zbcompile.json"  # written last, inside the checkpoint: its step and world size
PARTIAL = ".partial"  # the directory's suffix while it is being written
REPLACED = ".replaced"  # an older checkpoint under the same path, while it is being replaced
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class RankRecord:
    """What only one rank saves and restores. `layout` says where the schedule applies
    (`_layout_key`); `schedule`, `measured_costs` and `tuner` are None in one process or before
    a compile."""

    rng: dict[str, Any]
    extra: dict[str, Any]
    optimizer_history: list | None = None
    rollbacks: int = 0
    layout: tuple | None = None
    schedule: Any = None
    measured_costs: Any = None
    tuner: dict[str, Any] | None = field(default=None)


def save(path: str | os.PathLike, pipe: Any, optimizer: Any = None, **extra: Any) -> None:
    """Save `pipe`'s model, `optimizer`'s state (a torch optimizer or zbcompile's wrappers of
    one), the step count, this rank's RNG states and `extra` (any picklable values, e.g. the
    data position and an LR scheduler's `state_dict()`; `load` returns them) to the directory
    `path`, replacing an older checkpoint there. Every rank of the pipeline (all replicas) calls
    it; distributed, after a compile."""
    path = os.fspath(path).rstrip("/")
    group, distributed = _group(pipe)
    rank = dist.get_rank() if distributed else 0
    if hasattr(optimizer, "finish"):
        optimizer.finish()  # the pending step's validation, as the next pipe.step() would do it

    def prepare() -> dict[str, Any]:
        state: dict[str, Any] = {"model": pipe.state_dict(), "step": pipe.step_count}
        if optimizer is not None:
            state["optimizer"] = _optimizer_state(pipe, optimizer)
        state[f"rank{rank}"] = _rank_record(pipe, optimizer, extra)
        return state

    state = _on_every_rank(prepare, group, distributed)
    first = not distributed or dist.get_rank(group) == 0
    partial = path + PARTIAL
    if first and os.path.exists(partial):
        shutil.rmtree(partial)  # left by a save that did not finish
    _barrier(group, distributed)
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=partial, process_group=group, no_dist=not distributed)
    except (RuntimeError, OSError, CheckpointException) as error:  # a rank died, a disk filled up
        raise RuntimeError(
            f"rank {rank}: checkpoint {path!r} was not completed ({str(error).splitlines()[0]}); what was written "
            f"stays in {partial!r}, which zbcompile.checkpoint.latest() never takes"
        ) from error
    if first:
        with open(os.path.join(partial, MARKER), "w") as f:
            json.dump({"step": pipe.step_count, "world_size": dist.get_world_size(group) if distributed else 1}, f)
        _publish(partial, path)
    _barrier(group, distributed)


def load(path: str | os.PathLike, pipe: Any, optimizer: Any = None) -> dict[str, Any]:
    """Restore what `save` wrote to `path` into `pipe` (the entries this rank holds; distributed,
    after `pipe.compile(...)`), `optimizer` (built on `pipe.parameters()`), `pipe.step_count`,
    this rank's RNG states, and the schedule in use where it applies (module docstring); returns
    the `extra` given to `save` (this rank's, or the first rank's where the checkpoint has no
    such rank). Every rank of the pipeline calls it. Raises ValueError naming the entries this
    rank needs that the checkpoint lacks."""
    path = os.fspath(path).rstrip("/")
    saved = _saved_keys(path)
    group, distributed = _group(pipe)
    if hasattr(optimizer, "finish"):
        optimizer.finish()
    rank = dist.get_rank() if distributed else 0
    own = f"rank{rank}" in saved
    flat: dict[str, Any] = {}  # the optimizer's state, flattened (torch's helper initialises an empty one)

    def prepare() -> dict[str, Any]:
        model = {k: _empty_like_if_meta(v) for k, v in pipe.held_state_dict().items()}
        state: dict[str, Any] = {"model": model, "step": None, f"rank{rank if own else 0}": None}
        if optimizer is not None:
            _optimizer_owns(pipe, _inner(optimizer))
            flat.update(get_optimizer_state_dict(pipe.module, _inner(optimizer), options=_FLAT))
            state["optimizer"] = {k: v for k, v in flat.items() if not k.startswith("state.") or _stepped(saved, flat)}
        _require(saved, state, path)
        return state

    state = _on_every_rank(prepare, group, distributed)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, process_group=group, no_dist=not distributed)
    pipe.load_state_dict(state["model"])
    pipe.step_count = state["step"]
    if optimizer is not None:
        flat.update(state["optimizer"])
        set_optimizer_state_dict(pipe.module, _inner(optimizer), flat, options=_FLAT)
        if not _stepped(saved, flat):  # saved before the optimizer's first step: what torch's helper initialised goes
            _inner(optimizer).state.clear()
    record: RankRecord = state[f"rank{rank if own else 0}"]
    if own:
        _set_rng(record.rng)
        _restore_run(pipe, optimizer, record)
    return dict(record.extra)


def latest(directory: str | os.PathLike) -> str | None:
    """The complete checkpoint with the highest step count among the subdirectories of
    `directory` (ties: the last by name), or None. Incomplete ones (still `.partial`, or
    without DCP's `.metadata` or zbcompile's marker) are skipped."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        candidate = os.path.join(directory, name)
        if name.endswith((PARTIAL, REPLACED)) or not os.path.isfile(os.path.join(candidate, ".metadata")):
            continue
        try:
            with open(os.path.join(candidate, MARKER)) as f:
                step = int(json.load(f)["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append((step, name, candidate))
    return max(found)[2] if found else None


# --- what is saved ----------------------------------------------------------------------------


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself (zbcompile's post-validated and synchronous-clip wrappers hold one)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            "checkpoint: optimizer must be a torch.optim.Optimizer or a zbcompile wrapper of one, "
            f"got {type(optimizer).__name__}"
        )
    return inner


def _optimizer_state(pipe: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state by parameter FQN, flattened. An optimizer that has not stepped
    yet keeps no state: torch's helper initialises it with a zero-learning-rate step, which is
    undone here (and left out of the checkpoint) so that saving does not change the run."""
    inner = _inner(optimizer)
    _optimizer_owns(pipe, inner)
    had_state = bool(inner.state)
    flat = get_optimizer_state_dict(pipe.module, inner, options=_FLAT)
    if not had_state:
        inner.state.clear()
        flat = {k: v for k, v in flat.items() if not k.startswith("state.")}
    return flat


def _optimizer_owns(pipe: Any, inner: torch.optim.Optimizer) -> bool:
    """Whether `inner` has parameters; raises ValueError if one of them is not the pipe's (its
    FQN would be unknown)."""
    params = [p for group in inner.param_groups for p in group["params"]]
    mine = {id(p) for p in pipe.module.parameters()}
    foreign = sum(id(p) not in mine for p in params)
    if foreign:
        raise ValueError(
            f"checkpoint: the optimizer holds {foreign} parameters that are not the pipelined model's; build it on "
            "pipe.parameters() (after pipe.compile(...) in a distributed run)"
        )
    return bool(params)


def _rank_record(pipe: Any, optimizer: Any, extra: dict[str, Any]) -> RankRecord:
    record = RankRecord(rng=_rng_states(), extra=dict(extra))
    if optimizer is not None and hasattr(optimizer, "history"):
        record.optimizer_history = list(optimizer.history)
        record.rollbacks = getattr(optimizer, "rollbacks", 0)
    layout = _layout_key(pipe)
    if layout is not None:
        record.layout, record.schedule, record.measured_costs = layout, pipe.schedule, pipe.measured_costs
        record.tuner = pipe.tuner.state_dict() if pipe.tuner is not None else None
    return record


def _rng_states() -> dict[str, Any]:
    """Every generator a step may draw from: torch's CPU one, the CUDA devices' (where CUDA is
    in use), Python's and NumPy's."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:
        return states
    states["numpy"] = numpy.random.get_state()
    return states


def _layout_key(pipe: Any) -> tuple | None:
    """What a saved schedule depends on: the schedule option, this rank's place among the
    pipelines, and the cut (each stage's parameters and buffers). None before a compile."""
    try:
        compiled, runner = pipe.compiled, pipe.runner
    except RuntimeError:
        return None
    layout = runner.layout
    place = None if layout is None else (layout.pp_rank, layout.pp_size, layout.dp_size)
    cut = tuple((*s.param_fqns, *s.buffer_fqns) for s in compiled.partition.stages)
    return (pipe.options.schedule, place, cut)


# --- what is restored -------------------------------------------------------------------------


def _saved_keys(path: str) -> set[str]:
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(
            f"checkpoint: {path!r} is not a complete checkpoint (no DCP .metadata); "
            "zbcompile.checkpoint.latest(directory) finds the newest complete one"
        )
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def _stepped(saved: set[str], flat: dict[str, Any]) -> bool:
    """Whether the checkpoint holds optimizer state for this rank's parameters (not: saved
    before the optimizer's first step)."""
    return any(f"optimizer.{k}" in saved for k in flat if k.startswith("state."))


def _require(saved: set[str], state: dict[str, Any], path: str) -> None:
    """Raise ValueError naming what this rank needs that the checkpoint lacks."""
    wanted = [f"model.{k}" for k in state["model"]]
    wanted += [f"optimizer.{k}" for k in state.get("optimizer", {})]
    missing = [k for k in wanted if k not in saved]
    if missing:
        only_optimizer = all(k.startswith("optimizer.") for k in missing)
        what = "optimizer state (saved without an optimizer?)" if only_optimizer else "entries"
        raise ValueError(
            f"checkpoint {path!r} lacks {len(missing)} {what} this rank needs, e.g. {missing[:5]}; load it into "
            "the model it was saved from (the same parameter names), and pass optimizer= only if save() had one"
        )


def _empty_like_if_meta(value: Any) -> Any:
    """A CPU tensor to load into where the model's tensor is still on `meta` (one process,
    before a compile: `pipe.load_state_dict` materialises it)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.empty(value.shape, dtype=value.dtype)
    return value


def _set_rng(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def _restore_run(pipe: Any, optimizer: Any, record: RankRecord) -> None:
    """The wrapped optimizer's history, and where the layout is the saved one, the schedule in
    use with the costs it was solved with (so the run goes on as it would have)."""
    if optimizer is not None and record.optimizer_history is not None and hasattr(optimizer, "history"):
        optimizer.history[:] = record.optimizer_history
        if hasattr(optimizer, "rollbacks"):
            optimizer.rollbacks = record.rollbacks
    if record.layout is None or record.layout != _layout_key(pipe):
        return
    pipe.runner.reschedule(record.schedule)
    pipe.measured_costs = record.measured_costs
    if pipe.tuner is not None and record.tuner is not None:
        pipe.tuner.load_state_dict(record.tuner)


# --- files and groups -------------------------------------------------------------------------


def _publish(partial: str, path: str) -> None:
    """Give the written checkpoint its final name (an atomic rename), replacing an older one."""
    replaced = path + REPLACED
    if os.path.exists(replaced):
        shutil.rmtree(replaced)
    if os.path.exists(path):
        os.rename(path, replaced)
    os.rename(partial, path)
    if os.path.exists(replaced):
        shutil.rmtree(replaced)


def _group(pipe: Any) -> tuple[dist.ProcessGroup | None, bool]:
    """(the process group of every rank of the pipe's pipelines, None for the world; whether distributed)."""
    if not pipe.distributed:
        return None, False
    given = pipe.options.process_group
    if isinstance(given, DeviceMesh):
        ranks = tuple(sorted(given.mesh.flatten().tolist()))
        return (None if len(ranks) == dist.get_world_size() else _group_of(ranks)), True
    return given, True


@functools.cache
def _group_of(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group of `ranks` (made once; only its members take part)."""
    return dist.new_group(list(ranks), use_local_synchronization=True)


def _on_every_rank(prepare: Callable[[], Any], group: dist.ProcessGroup | None, distributed: bool) -> Any:
    """`prepare()`'s result, once every rank has prepared: where any rank raised, every rank
    raises (naming the ranks), so that none waits in DCP's collectives for one that gave up."""
    try:
        result, failure = prepare(), None
    except (ValueError, TypeError, RuntimeError) as error:
        result, failure = None, error
    if not distributed:
        if failure is not None:
            raise failure
        return result
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, None if failure is None else f"rank {dist.get_rank()}: {failure}", group=group)
    if failure is not None:
        raise failure
    failed = [f for f in failures if f is not None]
    if failed:
        raise RuntimeError(f"checkpoint: {len(failed)} other ranks could not take part: {'; '.join(failed)[:2000]}")
    return result


@contextlib.contextmanager
def _single_process_quiet():
    """Without DCP's warning that one process saves or loads alone (here, that is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group: dist.ProcessGroup | None, distributed: bool) -> None:
    if distributed:
        dist.barrier(group=group)
