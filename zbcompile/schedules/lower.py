"""Lowering: insert SEND/RECV actions (torch's naming) and prove the result deadlock-free.

A cross-rank edge F(s,k) -> F(s+1,k) becomes ``sSEND_Fk`` on the sender right after the producer
and ``(s+1)RECV_Fk`` on the receiver; a backward edge I/B(s,k) -> I/B(s-1,k) becomes ``sSEND_Bk``
and ``(s-1)RECV_Bk``. Edges between stages on the same rank need no message.

Placement follows the simulated timing: compute actions are emitted in order of their start
times, and a message's SEND and RECV are appended to both ranks' lists at the same moment. Every
rank therefore meets its messages in one global order, which rules out deadlock under blocking
(rendezvous) point-to-point semantics; ``check_rendezvous`` replays the lowered programs to confirm.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from .costs import Costs, ResolvedCosts, resolve_costs
from .ir import Action, Schedule
from .simulate import simulate
from .timing import ScheduleError, backward_index, dependencies


def message_of(action: Action, stages: int, stage_to_rank) -> tuple[Action, Action] | None:
    """(SEND, RECV) pair that carries ``action``'s output across ranks, or None. A mirrored copy
    (``Schedule.mirrored_from``) maps ranks one to one, so it crosses ranks where the first does."""
    s, k = action.stage, action.microbatch
    if action.kind == "F" and s < stages - 1 and stage_to_rank[s + 1] != stage_to_rank[s]:
        return Action(s, "SEND_F", k), Action(s + 1, "RECV_F", k)
    if action.kind in ("I", "B") and s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]:
        return Action(s, "SEND_B", k), Action(s - 1, "RECV_B", k)
    return None


def lower(schedule: Schedule, costs: Costs | ResolvedCosts | None = None) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions inserted, checked deadlock-free.

    ``costs`` only orders messages (default unit costs); any positive costs give a valid program.
    """
    compute = schedule.compute_only()
    sc = resolve_costs(costs, schedule.stages)
    sim = simulate(compute, sc)
    stage_to_rank = schedule.stage_to_rank
    out: list[list[Action]] = [[] for _ in range(schedule.ranks)]
    position = [0] * schedule.ranks
    emitted: set[Action] = set()
    backward_of = backward_index(compute.actions)
    heap = [(sim.start[row[0]], sim.end[row[0]], r) for r, row in enumerate(compute.actions) if row]
    heapq.heapify(heap)
    deferred: list[tuple[float, float, int]] = []
    while heap:
        start, end, rank = heapq.heappop(heap)
        action = compute.actions[rank][position[rank]]
        deps = dependencies(action, schedule.stages, stage_to_rank, 0.0, backward_of)
        if any(d.action not in emitted for d in deps):
            deferred.append((start, end, rank))  # a zero-time producer shares its time: retry after it
            continue
        out[rank].append(action)
        emitted.add(action)
        message = message_of(action, schedule.stages, stage_to_rank)
        if message is not None:
            send, recv = message
            out[rank].append(send)
            out[schedule.rank_of(recv.stage, recv.microbatch)].append(recv)
        position[rank] += 1
        if position[rank] < len(compute.actions[rank]):
            nxt = compute.actions[rank][position[rank]]
            heapq.heappush(heap, (sim.start[nxt], sim.end[nxt], rank))
        for item in deferred:
            heapq.heappush(heap, item)
        deferred.clear()
    if deferred:
        raise ScheduleError(
            f"cannot order messages for {[str(compute.actions[r][position[r]]) for _, _, r in deferred]}"
        )
    lowered = replace(schedule, actions=tuple(tuple(row) for row in out), info={**schedule.info, "lowered": True})
    check_rendezvous(lowered)
    return lowered


def check_rendezvous(schedule: Schedule) -> None:
    """Replay lowered programs with blocking sends and receives; raise ScheduleError on deadlock.

    A SEND and its RECV complete together, once both ranks have reached them. A compute action
    needs each cross-rank input to have been received earlier in its own rank's list.
    """
    rows = schedule.actions
    stages, stage_to_rank = schedule.stages, schedule.stage_to_rank
    backward_of = backward_index([[a for a in row if a.is_compute] for row in rows])
    done: set[Action] = set()
    position = [0] * len(rows)

    def head(rank: int) -> Action | None:
        return rows[rank][position[rank]] if position[rank] < len(rows[rank]) else None

    def peer_of(comm: Action) -> tuple[int, Action]:
        if comm.kind == "SEND_F":
            partner = Action(comm.stage + 1, "RECV_F", comm.microbatch)
        elif comm.kind == "SEND_B":
            partner = Action(comm.stage - 1, "RECV_B", comm.microbatch)
        elif comm.kind == "RECV_F":
            partner = Action(comm.stage - 1, "SEND_F", comm.microbatch)
        else:
            partner = Action(comm.stage + 1, "SEND_B", comm.microbatch)
        if not 0 <= partner.stage < stages:
            raise ScheduleError(f"{comm} has no partner stage {partner.stage}")
        return schedule.rank_of(partner.stage, partner.microbatch), partner

    def inputs_ready(rank: int, action: Action) -> Action | None:
        for dep in dependencies(action, stages, stage_to_rank, 0.0, backward_of):
            if schedule.rank_of(dep.action.stage, dep.action.microbatch) == rank:
                if dep.action not in done:
                    return dep.action
            else:
                recv = Action(action.stage, "RECV_F" if action.kind == "F" else "RECV_B", action.microbatch)
                if recv not in done:
                    return recv
        return None

    progress = True
    while progress:
        progress = False
        for rank in range(len(rows)):
            while (action := head(rank)) is not None:
                if action.is_compute:
                    if inputs_ready(rank, action) is not None:
                        break
                    done.add(action)
                    position[rank] += 1
                    progress = True
                    continue
                peer_rank, partner = peer_of(action)
                if head(peer_rank) != partner:
                    break
                done.update((action, partner))
                position[rank] += 1
                position[peer_rank] += 1
                progress = True
    blocked = [r for r in range(len(rows)) if head(r) is not None]
    if blocked:
        details = []
        for r in blocked:
            action = head(r)
            if action.is_compute:
                details.append(f"rank {r} blocks at {action} waiting for {inputs_ready(r, action)}")
            else:
                peer_rank, partner = peer_of(action)
                details.append(
                    f"rank {r} blocks at {action} until rank {peer_rank} reaches {partner} (it is at {head(peer_rank)})"
                )
        raise ScheduleError("lowered schedule deadlocks under blocking send/recv: " + "; ".join(details))
