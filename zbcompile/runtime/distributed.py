"""Runs this rank's part of a pipeline step with torch.distributed: follows its program
(`runtime/program.py`: the lowered action list of F, I, W, B and SEND/RECV), posts receives
ahead and waits only when a computation needs the data, and after the last W sums tied weights'
gradients between the ranks that hold them and averages gradients over data-parallel replicas.

Following readiness (the default): the program runs W after the sends the plan put them before
(`program.defer_weights`), and when a computation's message has not arrived yet, the rank runs
its next W in the meantime (in the program's W order, once its I has run) where the plan ran
that W before this computation anyway, or where it is expected to fit in the wait: the same
message was at least that late in recent steps (`WaitForecast`). So a late message costs no
more than the plan, and a message on time is not held up by a W the plan put before it."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zbcompile.compiler import CompiledPipeline
from zbcompile.runtime.dispatch import StepDispatch
from zbcompile.runtime.p2p import Pending, Transport
from zbcompile.runtime.program import RankProgram, Receive, rank_program
from zbcompile.runtime.stage import StageExecutor, merge_stage_grads
from zbcompile.runtime.tied_weights import share_owner_values, sum_gradients, tied_weights
from zbcompile.schedules import Action, Costs, Schedule
from zbcompile.schedules.costs import resolve_costs
from zbcompile.value_names import buffer_name, param_name


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
    """Executes one rank's stages of a compiled pipeline, step after step. With
    `follow_readiness` (see the module docstring) W may run elsewhere than the plan says, in the
    plan's order per rank; `moved_w` tells which did in the last step."""

    def __init__(
        self,
        compiled: CompiledPipeline,
        schedule: Schedule,
        layout: Layout,
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        timeout: timedelta,
        follow_readiness: bool = True,
    ) -> None:
        self.compiled = compiled
        self.schedule = schedule
        self.layout = layout
        self.device = device
        self.follow_readiness = follow_readiness
        self.rank = dist.get_rank()
        self.local_stages = [s for s, r in enumerate(schedule.stage_to_rank) if r == layout.pp_rank]
        self.executors = {s: StageExecutor(compiled.programs[s], state) for s in self.local_stages}
        self.transport = Transport(self.rank, timeout)
        self._set_program(schedule)
        self.tied_weights = tied_weights(compiled.partition.shared_params, schedule.stage_to_rank, layout.pipeline_ranks, self.rank)
        self.timeline: list[tuple[str, float, float]] = []  # (action, start, end) of the last step
        self.comm_timeline: list[tuple[str, float, float]] = []  # SEND_* posts and RECV_* waits, the same
        self.early_w: tuple[str, ...] = ()  # W of the last step run early, in a wait for a message
        self.forecast = WaitForecast()
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
                    for name in [*map(param_name, stage.param_fqns), *map(buffer_name, stage.buffer_fqns)]:
                        dist.broadcast(state[name], src=source, group=self.layout.dp_group)

    def rank_of(self, stage: int) -> int:
        return self.layout.pipeline_ranks[self.schedule.stage_to_rank[stage]]

    @property
    def actions(self) -> tuple[Action, ...]:
        """This rank's action list as it runs (the lowered schedule, W deferred past sends)."""
        return self.program.actions

    @property
    def moved_w(self) -> dict[str, tuple[str, ...]]:
        """W that ran elsewhere than the plan put them in the last step: "past_send", after a
        send the plan ran them before (the same every step of a schedule), and "into_wait", run
        early while a computation waited for a message."""
        return {"past_send": self.program.deferred, "into_wait": self.early_w}

    def step(self, inputs: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]):
        """One step; returns the microbatch losses on the rank holding the last stage, else None.
        Parameter gradients stay in the executors until `reduce_grads()`. `timeline` then holds
        (action, start, end) in `time.perf_counter()` seconds for every compute action, from
        when its data had arrived to when it finished, and `comm_timeline` the same for every
        SEND (posting it) and RECV (the wait for its data, when a computation needs it)."""
        program, transport, forecast, follow_readiness = self.program, self.transport, self.forecast, self.follow_readiness
        local: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        outgoing: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        # readiness asks whether a message has arrived only where a W may run in its wait
        def watch(key: tuple[str, int, int]) -> bool:
            return follow_readiness and (key in program.overtaken or (bool(program.weight_order) and forecast.worth_watching(key)))

        receives = _ReceivesAhead(program, transport, self.device, watch)
        weights = _WeightQueue(program.weight_order)
        timeline: list[tuple[str, float, float]] = []
        comm_timeline: list[tuple[str, float, float]] = []
        early: list[str] = []
        clock = time.perf_counter
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def run(action: Action, text: str) -> None:
            started = dispatch.run(action)
            synchronize()
            ended = clock()
            timeline.append((text, started, ended))
            if action.kind == "W":
                forecast.note_weight(action.stage, ended - started)

        def fetch(direction: str, stage: int, k: int, action: str) -> dict[str, torch.Tensor]:
            key = (direction, stage, k)
            if key in local:
                return local.pop(key)
            receive, pending = receives.take(key)
            reached = clock()
            if follow_readiness and transport.can_tell(pending):  # W while the message is on its way
                while (
                    (w := weights.runnable()) is not None
                    and (w in program.overtaken.get(key, ()) or forecast.fits(key, clock() - reached, w.stage))
                    and not transport.arrived(pending)
                ):
                    weights.advance()
                    run(w, str(w))
                    early.append(str(w))
            waited = clock()
            values = dict(zip(receive.message.names, transport.wait(pending, action)))
            done = clock()
            comm_timeline.append((receive.message.text, waited, done))
            forecast.note_wait(key, (transport.arrival_time(pending) or done) - reached)
            return values

        def deliver(direction: str, stage: int, k: int, values: dict[str, torch.Tensor]) -> None:
            (local if self.rank_of(stage) == self.rank else outgoing)[(direction, stage, k)] = values

        dispatch = StepDispatch(self.executors, self.schedule.stages, inputs, targets, fetch, deliver)
        for index, action in enumerate(program.actions):
            receives.post_ahead(index)
            kind = action.kind
            if kind == "W":
                if weights.planned():  # else it ran early, in a wait
                    run(action, program.texts[index])
            elif kind in ("RECV_F", "RECV_B"):
                receives.post_through(index)
            elif kind in ("SEND_F", "SEND_B"):
                message = program.messages[index]
                started = clock()
                values = outgoing.pop(message.key)
                transport.send([values[n] for n in message.names], message.peer, message.tag, message.text)
                comm_timeline.append((message.text, started, clock()))
            else:
                run(action, program.texts[index])
                if kind == "I":
                    weights.backward_ran(action)
        transport.flush_sends()
        forecast.end_step()
        self.timeline, self.comm_timeline, self.early_w = timeline, comm_timeline, tuple(early)
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
        self._set_program(schedule)

    def _set_program(self, schedule: Schedule) -> None:
        self.schedule = schedule
        compiled = self.compiled
        values = compiled.partition.values

        def names(direction: str, stage: int) -> Sequence[str]:
            return compiled.partition.stages[stage].inputs if direction == "F" else compiled.programs[stage].joint.output_grads

        memory = None
        if self.follow_readiness:  # the memory model the schedule was validated with (bytes)
            memory = resolve_costs(
                Costs(mem_b=[p.cost.mem_b for p in compiled.programs], mem_w=[p.cost.mem_w for p in compiled.programs]),
                schedule.stages,
            )
        self.program: RankProgram = rank_program(
            schedule, self.layout.pp_rank, self.rank_of, names, lambda n: (values[n].shape, values[n].dtype), memory
        )
        self.early_w = ()
        self.forecast = WaitForecast()

    @property
    def peak_live_bytes(self) -> int:
        return sum(e.peak_live_bytes for e in self.executors.values())


class WaitForecast:
    """What a rank expects of its waits, from its recent steps: how late each message was (from
    when the computation that needs it was reached to its arrival; negative: it was there
    first) and how long each stage's W took. Steps of one schedule repeat, so a message late in
    the last steps is likely late again."""

    RECENT_STEPS = 3

    def __init__(self) -> None:
        self.lateness: dict[tuple[str, int, int], deque[float]] = defaultdict(lambda: deque(maxlen=self.RECENT_STEPS))
        self.weight_seconds: dict[int, float] = {}  # per stage, the median W of the last step
        self._weights: dict[int, list[float]] = defaultdict(list)  # this step's

    def worth_watching(self, key: tuple[str, int, int]) -> bool:
        """Whether the wait for message `key` may leave room for a W: it was late by at least
        the shortest W in recent steps."""
        recent = self.lateness.get(key)
        return bool(recent) and bool(self.weight_seconds) and statistics.median(recent) >= min(self.weight_seconds.values())

    def fits(self, key: tuple[str, int, int], waited: float, stage: int) -> bool:
        """Whether a W of `stage` should fit in the rest of the wait for message `key`, of which
        `waited` seconds have passed (the median lateness of its recent steps says so)."""
        recent = self.lateness.get(key)
        if not recent or stage not in self.weight_seconds:
            return False
        return waited + self.weight_seconds[stage] <= statistics.median(recent)

    def note_wait(self, key: tuple[str, int, int], lateness: float) -> None:
        self.lateness[key].append(lateness)

    def note_weight(self, stage: int, seconds: float) -> None:
        self._weights[stage].append(seconds)

    def end_step(self) -> None:
        self.weight_seconds.update({stage: statistics.median(d) for stage, d in self._weights.items()})
        self._weights.clear()


class _WeightQueue:
    """The W of a step in the order they must run (the program's); the next one may run early
    once its stage's I for that microbatch has run."""

    def __init__(self, order: Sequence[Action]) -> None:
        self.order = order
        self.next = 0  # W run so far
        self.reached = 0  # W the program's list has reached
        self.backward_done: set[tuple[int, int]] = set()

    def backward_ran(self, action: Action) -> None:
        self.backward_done.add((action.stage, action.microbatch))

    def runnable(self) -> Action | None:
        """The next W, if it may run now."""
        if self.next < len(self.order):
            w = self.order[self.next]
            if (w.stage, w.microbatch) in self.backward_done:
                return w
        return None

    def advance(self) -> None:
        self.next += 1

    def planned(self) -> bool:
        """The list reached its next W: True if it is still to run (it is then run), False if it
        already ran early."""
        self.reached += 1
        if self.reached <= self.next:
            return False
        self.next += 1
        return True


RECEIVE_LOOKAHEAD = 4
"""Receives a rank keeps posted ahead of its place in the action list. gloo hands a message over
only once its receive is posted (the send waits for it), so a receive posted just before the
computation that needs it puts a round trip on the critical path; posted ahead, the transfer
overlaps the computation before it. Each one holds a boundary-sized buffer."""


class _ReceivesAhead:
    """One step's receives, posted in program order up to RECEIVE_LOOKAHEAD ahead of the action
    the rank is at, and always by the time the program reaches them. Where the transport matches
    messages by order rather than tag (every backend but gloo, NCCL among them), a receive is
    never posted before an earlier send to the same peer, so each peer still sees one order of
    operations. Where `watch(key)`, the transport can tell when a message has arrived."""

    def __init__(self, program: RankProgram, transport: Transport, device: torch.device, watch: Callable[[tuple[str, int, int]], bool]) -> None:
        self.plan = program.receives
        self.transport = transport
        self.device = device
        self.watch = watch
        self.in_order = not transport.matches_by_tag
        self.next = 0
        self.posted: dict[tuple[str, int, int], tuple[Receive, Pending]] = {}

    def post_ahead(self, index: int) -> None:
        """The rank is about to run action `index` (every earlier one has run)."""
        while self.next < len(self.plan) and len(self.posted) < RECEIVE_LOOKAHEAD:
            if self.in_order and self.plan[self.next].after >= index:
                break
            self._post_next()

    def post_through(self, index: int) -> None:
        """Post every receive up to and including the one at action `index`."""
        while self.next < len(self.plan) and self.plan[self.next].index <= index:
            self._post_next()

    def take(self, key: tuple[str, int, int]) -> tuple[Receive, Pending]:
        return self.posted.pop(key)

    def _post_next(self) -> None:
        receive = self.plan[self.next]
        message = receive.message
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in receive.layouts]
        pending = self.transport.post_recv(buffers, message.peer, message.tag, message.text, watch=self.watch(message.key))
        self.posted[message.key] = (receive, pending)
        self.next += 1
