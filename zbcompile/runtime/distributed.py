"""Runs this rank's part of a pipeline step with torch.distributed: interprets the lowered
action list (F, I, W, B and SEND/RECV), posts receives when the schedule names them and waits
only when a computation needs the data, and after the last W sums tied weights' gradients
between the ranks that hold them and averages gradients over data-parallel replicas."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.p2p import Pending, Transport
from zbcompile.runtime.dispatch import StepDispatch
from zbcompile.runtime.stage import StageExecutor, merge_stage_grads
from zbcompile.runtime.tied_weights import share_owner_values, sum_gradients, tied_weights
from zbcompile.schedules import Action, Schedule, lower


@dataclass(frozen=True)
class Layout:
    """This rank's place: `pp_rank` in a pipeline of `pp_size` ranks, replica `dp_rank` of
    `dp_size`. `pipeline_ranks[i]` is the global rank of pipeline position i in this replica,
    `replica_ranks[d]` the global rank of this position in replica d; `pp_group` and `dp_group`
    are process groups over them (None where they would hold this rank alone). `mesh` is the
    ("dp", "pp") DeviceMesh they come from, where there is one."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int
    pipeline_ranks: tuple[int, ...]
    replica_ranks: tuple[int, ...]
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh | None


def make_layout(pp_size: int, device: torch.device, description: str, group: dist.ProcessGroup | DeviceMesh | None = None) -> Layout:
    """The layout of pipelines of `pp_size` ranks over `group`: None (the default group: a
    ("dp", "pp") DeviceMesh over the world, every rank calls this), a process group of one
    pipeline's ranks (in group order), or a DeviceMesh with a "pp" dimension and optionally a
    "dp" one (e.g. a slice of a larger mesh)."""
    if isinstance(group, DeviceMesh):
        return _layout_of_mesh(group, pp_size, description)
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    if group is not None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of the process_group given to pipeline(): {ranks}")
        if len(ranks) != pp_size:
            raise ValueError(
                f"process_group of {len(ranks)} ranks does not fit {description}, which needs {pp_size} ranks per "
                "pipeline; give a process group of exactly one pipeline's ranks, or for data-parallel replicas a "
                "DeviceMesh with 'dp' and 'pp' dimensions"
            )
        return Layout(
            pp_size=pp_size,
            dp_size=1,
            pp_rank=ranks.index(rank),
            dp_rank=0,
            pipeline_ranks=tuple(ranks),
            replica_ranks=(rank,),
            pp_group=group if pp_size > 1 else None,
            dp_group=None,
            mesh=None,
        )
    if len(ranks) % pp_size:
        raise ValueError(
            f"world size {len(ranks)} does not fit {description}, which needs {pp_size} ranks per pipeline; "
            f"launch a multiple of {pp_size} processes (each extra multiple is a data-parallel replica)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = len(ranks) // pp_size
    mesh = init_device_mesh(device.type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = divmod(rank, pp_size)
    return Layout(
        pp_size=pp_size,
        dp_size=dp_size,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        pipeline_ranks=tuple(dp_rank * pp_size + i for i in range(pp_size)),
        replica_ranks=tuple(d * pp_size + pp_rank for d in range(dp_size)),
        pp_group=mesh.get_group("pp") if pp_size > 1 else None,
        dp_group=mesh.get_group("dp") if dp_size > 1 else None,
        mesh=mesh,
    )


def _layout_of_mesh(mesh: DeviceMesh, pp_size: int, description: str) -> Layout:
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or not set(names) <= {"pp", "dp"}:
        raise ValueError(
            f"a DeviceMesh given to pipeline() needs a 'pp' dimension and at most a 'dp' one besides, got "
            f"dimensions {names}; slice a larger mesh, e.g. mesh['dp', 'pp'] or mesh['pp']"
        )
    if mesh.size(names.index("pp")) != pp_size:
        raise ValueError(
            f"the DeviceMesh's 'pp' dimension has {mesh.size(names.index('pp'))} ranks but {description} needs {pp_size}"
        )
    pp_group = mesh.get_group("pp")
    dp_group = mesh.get_group("dp") if "dp" in names else None
    replica_ranks = tuple(dist.get_process_group_ranks(dp_group)) if dp_group is not None else (dist.get_rank(),)
    return Layout(
        pp_size=pp_size,
        dp_size=len(replica_ranks),
        pp_rank=mesh.get_local_rank("pp"),
        dp_rank=mesh.get_local_rank("dp") if dp_group is not None else 0,
        pipeline_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        replica_ranks=replica_ranks,
        pp_group=pp_group if pp_size > 1 else None,
        dp_group=dp_group if len(replica_ranks) > 1 else None,
        mesh=mesh,
    )


class DistributedRunner:
    """Executes one rank's stages of a compiled pipeline, step after step."""

    def __init__(
        self,
        compiled: CompiledPipeline,
        schedule: Schedule,
        layout: Layout,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        timeout: timedelta,
    ) -> None:
        self.compiled = compiled
        self.schedule = schedule
        self.layout = layout
        self.device = device
        self.rank = dist.get_rank()
        self.local_stages = [s for s, r in enumerate(schedule.stage_to_rank) if r == layout.pp_rank]
        self.executors = {s: StageExecutor(compiled.programs[s], state) for s in self.local_stages}
        self.transport = Transport(self.rank, timeout)
        self._set_actions(schedule)
        self.tied_weights = tied_weights(compiled.partition.shared_params, schedule.stage_to_rank, layout.pipeline_ranks, self.rank)
        self.timeline: list[tuple[str, float, float]] = []  # (action, start, end) of the last step
        self.comm_timeline: list[tuple[str, float, float]] = []  # SEND_* posts and RECV_* waits, the same
        self._synchronize_state(state)

    def _synchronize_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Start every copy of a parameter equal: a tied weight's copies take its owner's value,
        and replicas take replica 0's (each rank may have initialised its own)."""
        with torch.no_grad():
            share_owner_values(self.tied_weights, state, self.transport)
            if self.layout.dp_group is not None:
                source = self.layout.replica_ranks[0]
                for s in self.local_stages:
                    stage = self.compiled.partition.stages[s]
                    for name in [*(f"param:{f}" for f in stage.param_fqns), *(f"buffer:{f}" for f in stage.buffer_fqns)]:
                        dist.broadcast(state[name], src=source, group=self.layout.dp_group)

    def rank_of(self, stage: int) -> int:
        return self.layout.pipeline_ranks[self.schedule.stage_to_rank[stage]]

    def _forward_names(self, stage: int) -> tuple[str, ...]:
        """Values stage `stage` receives from its predecessor."""
        return self.compiled.partition.stages[stage].inputs

    def _backward_names(self, stage: int) -> tuple[str, ...]:
        """Gradients stage `stage` receives from its successor (of its outputs)."""
        return self.compiled.programs[stage].joint.output_grads

    def _buffers(self, names: Sequence[str]) -> list[torch.Tensor]:
        values = self.compiled.partition.values
        return [torch.empty(values[n].shape, dtype=values[n].dtype, device=self.device) for n in names]

    def step(self, inputs: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]):
        """One step; returns the microbatch losses on the rank holding the last stage, else None.
        Parameter gradients stay in the executors until `reduce_grads()`. `timeline` then holds
        (action, start, end) in `time.perf_counter()` seconds for every compute action, from
        when its data had arrived to when it finished, and `comm_timeline` the same for every
        SEND (posting it) and RECV (the wait for its data, when a computation needs it)."""
        local: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        outgoing: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        receives = _ReceivesAhead(self)
        clock = time.perf_counter

        def fetch(direction: str, stage: int, k: int, action: str) -> dict[str, torch.Tensor]:
            key = (direction, stage, k)
            if key in local:
                return local.pop(key)
            names = self._forward_names(stage) if direction == "F" else self._backward_names(stage)
            pending, waited = receives.take(key), clock()
            values = dict(zip(names, self.transport.wait(pending, action)))
            self.comm_timeline.append((pending.action, waited, clock()))
            return values

        def deliver(direction: str, stage: int, k: int, values: dict[str, torch.Tensor]) -> None:
            (local if self.rank_of(stage) == self.rank else outgoing)[(direction, stage, k)] = values

        dispatch = StepDispatch(self.executors, self.schedule.stages, inputs, targets, fetch, deliver)
        self.timeline, self.comm_timeline = [], []
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for index, action in enumerate(self.actions):
            receives.post_ahead(index)
            s, k, kind = action.stage, action.microbatch, action.kind
            started = clock()
            if kind in ("RECV_F", "RECV_B"):
                receives.post_through(index)
            elif kind == "SEND_F":
                outputs = outgoing.pop(("F", s + 1, k))
                self.transport.send([outputs[n] for n in self._forward_names(s + 1)], self.rank_of(s + 1), _tag("F", s + 1, k, self.schedule), str(action))
                self.comm_timeline.append((str(action), started, clock()))
            elif kind == "SEND_B":
                grads = outgoing.pop(("B", s - 1, k))
                self.transport.send([grads[n] for n in self._backward_names(s - 1)], self.rank_of(s - 1), _tag("B", s - 1, k, self.schedule), str(action))
                self.comm_timeline.append((str(action), started, clock()))
            else:
                started = dispatch.run(action)
                synchronize()
                self.timeline.append((str(action), started, clock()))
        self.transport.flush_sends()
        return dispatch.microbatch_losses() if self.schedule.stages - 1 in self.executors else None

    def reduce_grads(self) -> dict[str, torch.Tensor]:
        """This rank's parameter gradients for the step: its stages' parts summed in stage order,
        tied weights summed with the other ranks that hold them, then averaged over replicas."""
        grads = merge_stage_grads([self.executors[s] for s in self.local_stages])
        sum_gradients(self.tied_weights, grads, self.executors[self.local_stages[0]].state, self.transport)
        if self.layout.dp_group is not None:
            for fqn in sorted(grads):
                dist.all_reduce(grads[fqn], group=self.layout.dp_group)
                grads[fqn].div_(self.layout.dp_size)
        return grads

    def set_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Parameters and buffers (`param:<fqn>`, `buffer:<fqn>`) the next step computes with."""
        for executor in self.executors.values():
            executor.state = state

    def reschedule(self, schedule: Schedule) -> None:
        """Run `schedule` from the next step on (same stages on the same ranks)."""
        if schedule.stage_to_rank != self.schedule.stage_to_rank:
            raise ValueError(
                f"schedule {schedule.name!r} places stages on ranks {schedule.stage_to_rank}, but this pipeline "
                f"runs them on {self.schedule.stage_to_rank}; build a new pipeline for it"
            )
        self._set_actions(schedule)

    def _set_actions(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.actions: tuple[Action, ...] = lower(schedule).actions[self.layout.pp_rank]
        self.receive_plan = _receive_plan(self)

    @property
    def peak_live_bytes(self) -> int:
        return sum(e.peak_live_bytes for e in self.executors.values())


RECEIVE_LOOKAHEAD = 4
"""Receives a rank keeps posted ahead of its place in the action list. gloo hands a message over
only once its receive is posted (the send waits for it), so a receive posted just before the
computation that needs it puts a round trip on the critical path; posted ahead, the transfer
overlaps the computation before it. Each one holds a boundary-sized buffer."""


@dataclass(frozen=True)
class _Receive:
    """A RECV of the action list: at `index`, message `key` = (direction, stage, microbatch)
    from global rank `peer`; `after` is the index of the last SEND to that peer before it (-1)."""

    index: int
    key: tuple[str, int, int]
    peer: int
    tag: int
    names: tuple[str, ...]
    text: str
    after: int


def _receive_plan(runner: "DistributedRunner") -> list[_Receive]:
    plan, last_send = [], {}
    for index, action in enumerate(runner.actions):
        s, k = action.stage, action.microbatch
        if action.kind == "SEND_F":
            last_send[runner.rank_of(s + 1)] = index
        elif action.kind == "SEND_B":
            last_send[runner.rank_of(s - 1)] = index
        elif action.kind in ("RECV_F", "RECV_B"):
            forward = action.kind == "RECV_F"
            peer = runner.rank_of(s - 1 if forward else s + 1)
            names = runner._forward_names(s) if forward else runner._backward_names(s)
            direction = "F" if forward else "B"
            plan.append(_Receive(index, (direction, s, k), peer, _tag(direction, s, k, runner.schedule), names, str(action), last_send.get(peer, -1)))
    return plan


class _ReceivesAhead:
    """One step's receives, posted in list order up to RECEIVE_LOOKAHEAD ahead of the action the
    rank is at, and always by the time the list reaches them. Where the transport matches messages
    by order rather than tag (every backend but gloo, NCCL among them), a receive is never posted
    before an earlier send to the same peer, so each peer still sees one order of operations."""

    def __init__(self, runner: "DistributedRunner") -> None:
        self.runner = runner
        self.plan = runner.receive_plan
        self.next = 0
        self.posted: dict[tuple[str, int, int], Pending] = {}

    def post_ahead(self, index: int) -> None:
        """The rank is about to run action `index` (every earlier one has run)."""
        in_order = not self.runner.transport.matches_by_tag
        while self.next < len(self.plan) and len(self.posted) < RECEIVE_LOOKAHEAD:
            if in_order and self.plan[self.next].after >= index:
                break
            self._post_next()

    def post_through(self, index: int) -> None:
        """Post every receive up to and including the one at action `index`."""
        while self.next < len(self.plan) and self.plan[self.next].index <= index:
            self._post_next()

    def take(self, key: tuple[str, int, int]) -> Pending:
        return self.posted.pop(key)

    def _post_next(self) -> None:
        receive = self.plan[self.next]
        buffers = self.runner._buffers(receive.names)
        self.posted[receive.key] = self.runner.transport.post_recv(buffers, receive.peer, receive.tag, receive.text)
        self.next += 1


def _tag(direction: str, stage: int, microbatch: int, schedule: Schedule) -> int:
    """A distinct tag per message of a step (gloo matches messages by tag)."""
    return (microbatch * schedule.stages + stage) * 2 + (direction == "B")
