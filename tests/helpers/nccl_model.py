"""A model of NCCL's point-to-point semantics, to replay what the real runtime posts without a GPU.

The runtime's own code runs: `runtime/dispatch.Interpreter` (with `readiness.ReceivesAhead`,
`program.rank_program`), `transport.Transport` and `action_clock.EventClock`, over stand-ins for what
sits below them: `torch.distributed` (an NCCL backend whose works record what the host asked
for), CUDA events, `torch.cuda.synchronize`, and stage executors that only record their action.
One step of each rank runs on the host first (the host only queues work on a GPU; whether a
message has arrived is answered "not yet", the host being ahead of the device) and leaves a log
per rank; `replay` then runs the logs under NCCL's rules:

- compute actions run on one compute stream, in the order queued;
- a rank's point-to-point operations run on one NCCL stream in the order posted (one
  communicator per process group, as with `init_process_group(device_id=...)`), each starting
  only once the compute queued before its posting has finished (torch's stream sync);
- a send and the receive it pairs with (the n-th send from A to B with the n-th receive on B
  from A: NCCL pairs by order, not tag) complete together, once both are at the head of their
  streams (rendezvous); their tags and sizes must agree, else the messages would be mixed up;
- `work.wait()` makes the compute stream wait for the operation; `work.wait(timeout)` blocks
  the host until it completes; `torch.cuda.synchronize()` blocks the host until everything
  queued on the device has completed; waiting for an event blocks the host until the compute
  stream has reached it.

A replay that cannot finish every rank's log is a deadlock on a real GPU (`Deadlock`).
`check_overlap` asks more of a log: the host never waits for the device before the step's work
is all queued (`HostBlocked`), and the compute stream waits for a message only right before the
computation that consumes it (`NeedlessWait`), so no computation waits for a communication it
does not consume."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch

from zbcompile.runtime.step import rank_program as program_module
from zbcompile.runtime.step import transport as transport_module
from zbcompile.runtime.step.action_clock import EventClock
from zbcompile.runtime.step.dispatch import Interpreter
from zbcompile.runtime.step.rank_program import rank_program
from zbcompile.runtime.step.transport import Transport
from zbcompile.schedules import Costs, Schedule, lower
from zbcompile.schedules.costs import resolve_costs

# what a message carries: two values of different dtypes, so that every message is a flat buffer
NAMES = ("hidden", "mask")
LAYOUTS = {"hidden": (torch.Size([3, 2]), torch.float32), "mask": (torch.Size([5]), torch.bool)}


class Deadlock(AssertionError):
    """The replay stopped with work left: what each unfinished rank waits for."""


class Mismatch(AssertionError):
    """NCCL would pair a send with a receive of another message."""


class HostBlocked(AssertionError):
    """The host waits for the device while work of the step is still to be queued."""


class NeedlessWait(AssertionError):
    """The compute stream waits for a message before a computation that does not consume it."""


@dataclass
class Op:
    rank: int
    kind: str  # "send" or "recv"
    peer: int
    tag: int
    nbytes: int
    index: int = 0  # the n-th operation of this kind between the pair
    after_compute: int = 0  # compute items queued before it was posted
    done: bool = False


class Work:
    """A posted operation, as torch's NCCL work: `wait()` queues a stream wait, `wait(timeout)`
    blocks the host; `is_completed()` is False (the host is ahead of the device)."""

    def __init__(self, model: Model, op: Op) -> None:
        self.model, self.op = model, op

    def wait(self, timeout: Any = None) -> bool:
        self.model.log(("stream_wait", self.op) if timeout is None else ("host_wait", self.op))
        return True

    def is_completed(self) -> bool:
        return False


class Event:
    """A CUDA event: recording it marks the compute stream (nothing to wait for); asking whether
    the stream reached it blocks the host until it has (the answer is then yes)."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def record(self) -> None:
        pass

    def query(self) -> bool:
        self.model.log(("stream_sync",))
        return True

    def synchronize(self) -> None:
        self.model.log(("stream_sync",))

    def elapsed_time(self, other: Event) -> float:
        return 0.0


@dataclass
class Model:
    """Every rank's log of one step, filled while the ranks' interpreters run (one at a time)."""

    ranks: int
    logs: list[list[tuple]] = field(default_factory=list)
    rank: int = 0
    _pairs: dict[tuple[str, int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.logs = [[] for _ in range(self.ranks)]

    def log(self, item: tuple) -> None:
        self.logs[self.rank].append(item)

    def post(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        key = (kind, self.rank, peer)
        op = Op(self.rank, kind, peer, tag, tensor.numel() * tensor.element_size(), self._pairs.get(key, 0))
        self._pairs[key] = op.index + 1
        self.log(("post", op))
        return Work(self, op)

    def dist(self) -> SimpleNamespace:
        """Stands in for `torch.distributed` inside `runtime/step/transport.py`: an NCCL process group."""
        return SimpleNamespace(
            get_backend=lambda group=None: "nccl",
            isend=lambda tensor, dst, group=None, tag=0: self.post("send", tensor, dst, tag),
            irecv=lambda tensor, src, group=None, tag=0: self.post("recv", tensor, src, tag),
        )

    def synchronize(self, device: Any = None) -> None:
        """Stands in for `torch.cuda.synchronize`."""
        self.log(("device_sync",))


class Stage:
    """Stands in for a StageExecutor: records its action, returns values of the right names."""

    def __init__(self, model: Model, stage: int, last: int) -> None:
        self.model, self.stage, self.last = model, stage, last

    def _values(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in LAYOUTS.items()}

    def forward(self, microbatch: int, inputs) -> dict[str, torch.Tensor]:
        self.model.log(("compute", f"{self.stage}F{microbatch}"))
        return {"loss": torch.zeros(())} if self.stage == self.last else self._values()

    def input_backward(self, microbatch: int, grads) -> dict[str, torch.Tensor]:
        self.model.log(("compute", f"{self.stage}I{microbatch}"))
        return self._values() if self.stage else {}

    def backward(self, microbatch: int, grads) -> dict[str, torch.Tensor]:
        self.model.log(("compute", f"{self.stage}B{microbatch}"))
        return self._values() if self.stage else {}

    def weight_backward(self, microbatch: int) -> None:
        self.model.log(("compute", f"{self.stage}W{microbatch}"))


def run_step(schedule: Schedule, follow_readiness: bool, fill_waits: bool, monkeypatch, edit=None) -> Model:
    """One step of every rank of `schedule` through the real interpreter and transport, on the
    model's NCCL; returns the model holding each rank's log. `fill_waits`: the forecast expects
    every wait to fit a W (the most W moved into waits). `edit(program)`: the program to run
    instead of each rank's (a test's deliberate fault)."""
    model = Model(schedule.ranks)
    lowered = lower(schedule)  # what `rank_program` lowers, once for every rank
    monkeypatch.setattr(program_module, "lower", lambda given: lowered if given is schedule else lower(given))
    monkeypatch.setattr(transport_module, "dist", model.dist())
    monkeypatch.setattr(torch.cuda, "synchronize", model.synchronize)
    stages, microbatches = schedule.stages, schedule.microbatches
    memory = resolve_costs(Costs(mem_b=[1.0] * stages, mem_w=[0.5] * stages), stages) if follow_readiness else None
    for rank in range(schedule.ranks):
        model.rank = rank
        program = rank_program(
            schedule, rank, schedule.rank_of, lambda carries, stage: NAMES, LAYOUTS.__getitem__, memory
        )
        program = edit(program) if edit is not None else program
        transport = Transport(rank, timedelta(seconds=60))
        transport.device = torch.device("cpu")
        executors = {s: Stage(model, s, stages - 1) for s in schedule.stages_on(rank)}
        interpreter = Interpreter(
            executors, transport, torch.device("cpu"), follow_readiness, clock=EventClock(lambda: Event(model))
        )
        interpreter.load(program, schedule)
        if fill_waits:
            interpreter.mail.forecast.fits = lambda *args: True
        inputs = [{"x": torch.zeros(1)} for _ in range(microbatches)]
        interpreter.step(inputs, [{} for _ in range(microbatches)])
    return model


def check_overlap(model: Model, stages: int) -> None:
    """Raise HostBlocked or NeedlessWait (module docstring) for the first rank whose log shows it."""
    for rank, log in enumerate(model.logs):
        work = [i for i, item in enumerate(log) if item[0] in ("compute", "post")]
        for i, item in enumerate(log[: work[-1] if work else 0]):
            if item[0] in ("host_wait", "device_sync", "stream_sync"):
                queued = next(log[j] for j in work if j > i)
                raise HostBlocked(f"rank {rank}: the host waits ({item[0]}) before queueing {_item_text(queued)}")
        computations = [item for item in log if item[0] in ("compute", "stream_wait")]
        for i, item in enumerate(computations):
            if item[0] == "stream_wait":
                consumer = next((c[1] for c in computations[i:] if c[0] == "compute"), None)
                if consumer not in _consumers(item[1].tag, stages):
                    raise NeedlessWait(
                        f"rank {rank}: the compute stream waits for {_op_text(item[1])} before {consumer}"
                    )


def _consumers(tag: int, stages: int) -> tuple[str, ...]:
    """The computations that consume the message of `tag` (`program.message_tag`)."""
    position, backward = divmod(tag, 2)
    microbatch, stage = divmod(position, stages)
    return (f"{stage}I{microbatch}", f"{stage}B{microbatch}") if backward else (f"{stage}F{microbatch}",)


def _item_text(item: tuple) -> str:
    return _op_text(item[1]) if item[0] == "post" else item[1]


def replay(model: Model) -> None:
    """Run the logs under NCCL's rules (module docstring); raise Deadlock or Mismatch."""
    logs = model.logs
    ranks = len(logs)
    host = [0] * ranks
    compute: list[list[tuple]] = [[] for _ in range(ranks)]
    comm: list[list[Op]] = [[] for _ in range(ranks)]
    ran = [0] * ranks  # compute items finished
    sent = [0] * ranks  # NCCL operations finished
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            while host[r] < len(logs[r]):
                item = logs[r][host[r]]
                kind = item[0]
                if kind in ("compute", "stream_wait"):
                    compute[r].append(item)
                elif kind == "post":
                    item[1].after_compute = len(compute[r])
                    comm[r].append(item[1])
                elif kind == "host_wait" and not item[1].done:
                    break
                elif kind == "device_sync" and (ran[r] < len(compute[r]) or sent[r] < len(comm[r])):
                    break
                elif kind == "stream_sync" and ran[r] < len(compute[r]):
                    break
                host[r] += 1
                progress = True
            while ran[r] < len(compute[r]) and (compute[r][ran[r]][0] == "compute" or compute[r][ran[r]][1].done):
                ran[r] += 1
                progress = True
        for r in range(ranks):
            if sent[r] < len(comm[r]) and _rendezvous(r, comm, ran, sent):
                progress = True
    stuck = [r for r in range(ranks) if host[r] < len(logs[r]) or ran[r] < len(compute[r]) or sent[r] < len(comm[r])]
    if stuck:
        raise Deadlock("; ".join(_blocked(r, logs, host, compute, ran, comm, sent) for r in stuck))


def _ready(r: int, comm: list[list[Op]], ran: list[int], sent: list[int]) -> Op | None:
    """Rank r's NCCL operation at the head of its stream, if the compute before it has finished."""
    if sent[r] >= len(comm[r]):
        return None
    op = comm[r][sent[r]]
    return op if ran[r] >= op.after_compute else None


def _rendezvous(r: int, comm, ran, sent) -> bool:
    op = _ready(r, comm, ran, sent)
    if op is None:
        return False
    partner = _ready(op.peer, comm, ran, sent)
    wanted = "recv" if op.kind == "send" else "send"
    if partner is None or partner.peer != r or partner.kind != wanted or partner.index != op.index:
        return False
    if (partner.tag, partner.nbytes) != (op.tag, op.nbytes):
        raise Mismatch(
            f"rank {r}'s {op.kind} #{op.index} (tag {op.tag}, {op.nbytes} B) would pair with rank {op.peer}'s "
            f"{partner.kind} of tag {partner.tag}, {partner.nbytes} B"
        )
    op.done = partner.done = True
    sent[r] += 1
    sent[op.peer] += 1
    return True


def _blocked(r, logs, host, compute, ran, comm, sent) -> str:
    waits = []
    if host[r] < len(logs[r]):
        item = logs[r][host[r]]
        waits.append(
            f"host at {item[0]}" + (f" on {_op_text(item[1])}" if len(item) > 1 and isinstance(item[1], Op) else "")
        )
    if ran[r] < len(compute[r]):
        item = compute[r][ran[r]]
        waits.append(f"compute stream at {item[1] if item[0] == 'compute' else 'a wait for ' + _op_text(item[1])}")
    if sent[r] < len(comm[r]):
        waits.append(f"NCCL stream at {_op_text(comm[r][sent[r]])}")
    return f"rank {r}: " + ", ".join(waits)


def _op_text(op: Op) -> str:
    return f"{op.kind} {'to' if op.kind == 'send' else 'from'} rank {op.peer} (tag {op.tag})"
