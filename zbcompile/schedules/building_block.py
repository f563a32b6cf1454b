"""V-shape schedules from a repeated building block: V-Min, V-Half and V-ZB (Qi, Wan, Amar, Lin,
"Pipeline Parallelism with Controllable Memory", 2024; the authors' ``zbv_greedy.py``).

Placement: p ranks, two chunks each in a V (``handcrafted.v_placement``): rank r holds chunk 0 =
stage r and chunk 1 = stage 2p-1-r, so a microbatch goes down the ranks and back up and its loss
is on rank 0. Time is counted in slots, one F, I or W of a chunk per slot (the paper's
T_F = T_B = T_W); the schedules run under any costs afterwards (the order is what they fix).

A **building block** is one microbatch's schedule: per rank the slots of its F on chunk 0, F on
chunk 1, I on chunk 1 and I on chunk 0. Microbatch k runs the block shifted by 6k slots (every rank
does six actions per microbatch: two F, two I, two W), so in the steady state every slot is busy.
The peak activation memory of a rank is about the sum of its two chunks' lifespans (F to I) over
the interval 6, in chunk activations; a 1F1B stage holds p microbatches of two chunks:

- V-Min: lifespans sum to about 4p (the tightest chain): about 1/3 of 1F1B's memory;
- V-Half: about 6p (forwards two slots apart): 1/2 of 1F1B's memory;
- V-ZB: about 12p (forwards four slots apart, ZB-V's steady state): 1F1B's memory.

Each chunk's lifespan is rounded up to whole intervals, so at small p the fractions are higher
(``benchmarks/results/memory_table.md``). W runs in the first free slot after its I (the oldest
pending W first). Only the first m microbatches are kept, which leaves free slots in the warm-up
and cool-down; ``squeeze`` then moves every F and I, in slot order, to the earliest free slot its
inputs allow where that keeps the rank's peak within the repeated block's (the authors' rule: less
bubble, no more memory). Every action then sits in a slot after all of its inputs, so each rank's
order (slot order) cannot deadlock.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from .handcrafted import v_placement
from .ir import Action, Schedule

INTERVAL = 6  # slots per microbatch and rank: F, F, I, I, W, W
BUILT_KEPT = 32  # schedules of a shape kept (they depend on stages and microbatches alone; immutable)
Block = Sequence[tuple[int, int, int, int]]  # per rank: slots of F chunk 0, F chunk 1, I chunk 1, I chunk 0


def v_min_block(ranks: int) -> list[tuple[int, int, int, int]]:
    """The tightest block: each F and I right after its input (one slot later), plus a gap of 2
    slots before the backward when 3 divides p, so that no two actions of a rank share a slot
    modulo 6."""
    p, gap = ranks, (2 if ranks % 3 == 0 else 0)
    return [(r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r) for r in range(p)]


def v_half_block(ranks: int) -> list[tuple[int, int, int, int]]:
    """Forwards two slots apart on the way down, so chunk 0 lives about 6p - 3r slots and chunk 1
    about 3r: the lifespans sum to about 6p (a gap of 3 before the backward when p is even)."""
    p, gap = ranks, (3 if ranks % 2 == 0 else 0)
    return [(2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1, 6 * p + gap - 2 - r) for r in range(p)]


def v_zb_block(ranks: int) -> list[tuple[int, int, int, int]]:
    """Forwards four slots apart on the way down: the lifespans sum to about 12p, 1F1B's memory
    (the steady state of ZB-V, ``handcrafted.zb_v``, under unit costs)."""
    p = ranks
    return [(4 * r, 6 * p - 3 - 2 * r, 6 * p - 2 + 4 * r, 12 * p - 5 - 2 * r) for r in range(p)]


def _stages_of_rank(ranks: int, rank: int) -> tuple[int, int]:
    return rank, 2 * ranks - 1 - rank


def _inputs(action: Action, stages: int) -> list[Action]:
    """The actions ``action`` waits for (across ranks and on its own rank), and the same kind's
    previous microbatch on its stage (the order invariant)."""
    s, kind, k = action.stage, action.kind, action.microbatch
    needs = [Action(s, kind, k - 1)] if k > 0 else []
    if kind == "F":
        needs += [Action(s - 1, "F", k)] if s > 0 else []
    else:
        needs += [Action(s, "F", k)] + ([Action(s + 1, "I", k)] if s + 1 < stages else [])
    return needs


class _Slots:
    """The F and I of every rank at their slots (``at[rank][slot]``, None when free); each rank's
    W go into its free slots when its program is read (``row``)."""

    def __init__(self, ranks: int, microbatches: int, block: Block):
        self.ranks, self.microbatches, self.stages = ranks, microbatches, 2 * ranks
        horizon = max(max(b) for b in block) + INTERVAL * microbatches + 1
        self.slot: dict[Action, int] = {}
        self.at: list[list[Action | None]] = [[None] * horizon for _ in range(ranks)]
        for r, offsets in enumerate(block):
            down, up = _stages_of_rank(ranks, r)
            for (stage, kind), offset in zip(((down, "F"), (up, "F"), (up, "I"), (down, "I")), offsets):
                for k in range(microbatches):
                    self.put(r, Action(stage, kind, k), offset + INTERVAL * k)

    def put(self, rank: int, action: Action, slot: int) -> None:
        self.slot[action] = slot
        self.at[rank][slot] = action

    def move(self, rank: int, action: Action, slot: int) -> None:
        self.at[rank][self.slot[action]] = None
        self.put(rank, action, slot)

    def row(self, rank: int) -> list[Action]:
        """Rank ``rank``'s program: its F and I in slot order, each W (in microbatch order per
        stage, the oldest pending first) in the first free slot after its I."""
        row: list[Action] = []
        pending: list[Action] = []
        for action in self.at[rank]:
            if action is not None:
                row.append(action)
                if action.kind == "I":
                    pending.append(Action(action.stage, "W", action.microbatch))
            elif pending:
                row.append(pending.pop(0))
        return row + pending

    def peak(self, rank: int) -> int:
        """Rank ``rank``'s peak in chunk activations, an activation held from its F until its W
        (the W in the free slots, as ``row`` places them)."""
        level = peak = pending = 0
        for action in self.at[rank]:
            if action is None:
                if pending:
                    pending -= 1
                    level -= 1
            elif action.kind == "F":
                level += 1
                if level > peak:
                    peak = level
            else:
                pending += 1
        return peak


def squeeze(slots: _Slots, caps: Sequence[int]) -> None:
    """Move every F and I, in slot order, to the earliest free slot after its inputs where its
    rank's peak stays within ``caps[rank]`` (see the module docstring)."""
    placement = v_placement(slots.stages)
    for action in sorted(slots.slot, key=lambda a: (slots.slot[a], a.stage)):
        rank = placement[action.stage]
        at = slots.at[rank]
        here = slots.slot[action]
        earliest = 1 + max((slots.slot[d] for d in _inputs(action, slots.stages)), default=-1)
        for t in range(earliest, here):
            if at[t] is not None:
                continue
            slots.move(rank, action, t)
            if slots.peak(rank) <= caps[rank]:  # an earlier I can push a W later
                break
            slots.move(rank, action, here)


def building_block_schedule(name: str, stages: int, microbatches: int, block: Block) -> Schedule:
    """The schedule of ``block`` repeated for ``microbatches`` microbatches on ``stages`` // 2 ranks,
    squeezed within each rank's peak in the repeated block (chunk activations held from F to W)."""
    if stages < 2 or stages % 2:
        raise ValueError(f"{name} puts two chunks on each rank: stages (chunks) must be even and >= 2, got {stages}")
    ranks = stages // 2
    slots = _Slots(ranks, microbatches, block)
    squeeze(slots, [slots.peak(r) for r in range(ranks)])
    rows = tuple(tuple(slots.row(r)) for r in range(ranks))
    return Schedule(name, stages, microbatches, v_placement(stages), rows, {"building_block": [list(b) for b in block]})


@lru_cache(maxsize=BUILT_KEPT)
def v_min(stages: int, microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory."""
    return building_block_schedule("v-min", stages, microbatches, v_min_block(stages // 2))


@lru_cache(maxsize=BUILT_KEPT)
def v_half(stages: int, microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activation memory."""
    return building_block_schedule("v-half", stages, microbatches, v_half_block(stages // 2))


@lru_cache(maxsize=BUILT_KEPT)
def v_zb(stages: int, microbatches: int) -> Schedule:
    """V-ZB: 1F1B's memory and no bubble in the steady state."""
    return building_block_schedule("v-zb", stages, microbatches, v_zb_block(stages // 2))
