"""DeepSeek's DualPipe and DualPipeV (https://github.com/deepseek-ai/DualPipe, DeepSeek-V3 report).

DualPipeV, in the form torch.distributed.pipelining's ``ScheduleDualPipeV`` generates:

Placement: the V of ZB-V (``handcrafted.v_placement``): rank r holds chunk 0 = stage r and chunk 1 =
stage 2p-1-r. Each rank runs eight phases (p ranks, m microbatches, rank r):

1. 2(p-r-1) forwards of chunk 0;
2. r+1 pairs (F chunk 0, F chunk 1);
3. p-r-1 triples (I chunk 1, the oldest pending W, F chunk 1);
4. m-2p+r+1 steps of two overlapped pairs (F chunk 0 with B chunk 1, F chunk 1 with B chunk 0;
   the last rank runs its first F chunk 0 and B chunk 1 apart, not overlapped);
5. p-r-1 pairs (B chunk 1, then F chunk 1 overlapped with B chunk 0);
6. r+1 pairs (backward chunk 1, backward chunk 0), fused B for the first half and I from the
   middle on (the W are deferred to fill the drain);
7. p-r-1 pairs (the oldest pending W, backward chunk 0);
8. the remaining W.

An overlapped pair is one microbatch's forward computed while another's backward runs (DeepSeek
overlaps their communication with the other's computation). A pair is its two actions back to back,
forward first, in the order torch's runtime runs the sub-actions, and is recorded in
``Schedule.overlapped``, so ``to_csv`` writes it as torch does, ``(0F7;7B3)OVERLAP_F_B``. DualPipeV
needs m >= 2p; for fewer microbatches the order for 2p is built and the extra microbatches are
dropped (removing whole microbatches keeps an order free of deadlock, as in ``handcrafted.zb_v``).

DualPipe (bidirectional): p ranks (p even) and a pipeline of p stages that exists twice. Copy 0
runs stage s on rank s ("down") and the first ceil(m/2) microbatches; copy 1 runs stage s on rank
p-1-s ("up") and the others (``Schedule.mirrored_from``). Rank r thus holds two stages, r and
p-1-r, which sit at positions h and p-1-h of their copies' pipelines (h = min(r, p-1-r)): the
places of a DualPipeV rank h's two chunks in a V of p stages on p/2 ranks. DeepSeek's DualPipe
runs on rank r the eight phases of that DualPipeV rank (its "chunk 0" is the copy in which rank r
sits at position h), each direction with its own half of the microbatches; so does ``dualpipe``,
built from ``_rank_actions``. DeepSeek needs m even and m/2 >= p; here the order is built for
max(ceil(m/2), p) microbatches per direction and the ones beyond each copy's share are dropped,
as above. Both ranks holding a stage keep its parameters, and the runtime adds the two copies'
gradients after the step: (sum over copy 0's microbatches) + (sum over copy 1's), which is not
bit for bit the sum in microbatch order that every single-copy schedule computes (floating-point
addition is not associative), only equal to it within rounding.
"""

from __future__ import annotations

from functools import lru_cache

from .building_block import BUILT_KEPT
from .handcrafted import in_line, v_placement
from .ir import Action, Schedule


class _RankProgram:
    """One rank's actions and the next microbatch of every (stage, kind)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[int, str], int] = {}
        self.pending_w: list[Action] = []
        self.overlapped: list[tuple[Action, Action]] = []

    def put(self, stage: int, kind: str) -> None:
        """The next ``kind`` on ``stage``; B and I share one count (a microbatch gets one of them)."""
        key = (stage, "I" if kind == "B" else kind)
        k = self.next.get(key, 0)
        self.next[key] = k + 1
        self.actions.append(Action(stage, kind, k))
        if kind == "I":
            self.pending_w.append(Action(stage, "W", k))

    def put_overlapped(self, forward_stage: int, backward_stage: int) -> None:
        """A forward of ``forward_stage`` beside a fused backward of ``backward_stage``, F first."""
        self.put(forward_stage, "F")
        self.put(backward_stage, "B")
        self.overlapped.append((self.actions[-2], self.actions[-1]))

    def put_w(self) -> None:
        """The oldest pending W, if any."""
        if self.pending_w:
            self.actions.append(self.pending_w.pop(0))


def _rank_actions(ranks: int, microbatches: int, rank: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Rank ``rank``'s actions and its overlapped (F, B) pairs."""
    p, r, m = ranks, rank, microbatches
    down, up = r, 2 * p - 1 - r
    prog = _RankProgram()
    for _ in range(2 * (p - r - 1)):
        prog.put(down, "F")
    for _ in range(r + 1):
        prog.put(down, "F")
        prog.put(up, "F")
    for _ in range(p - r - 1):
        prog.put(up, "I")
        prog.put_w()
        prog.put(up, "F")
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the last rank's first pair runs apart (a smaller bubble, as DeepSeek does)
            prog.put(down, "F")
            prog.put(up, "B")
        else:
            prog.put_overlapped(down, up)
        prog.put_overlapped(up, down)
    for _ in range(p - r - 1):
        prog.put(up, "B")
        prog.put_overlapped(up, down)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        prog.put(up, "I" if split else "B")
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        prog.put(down, "I" if split else "B")
    for _ in range(p - r - 1):
        prog.put_w()
        prog.put(down, "I" if split else "B")
    for _ in range(r + 1):
        prog.put_w()
    return prog.actions + prog.pending_w, prog.overlapped


@lru_cache(maxsize=BUILT_KEPT)
def dualpipev(stages: int, microbatches: int) -> Schedule:
    """DualPipeV on ``stages`` // 2 ranks (see the module docstring)."""
    if stages < 2 or stages % 2:
        raise ValueError(f"dualpipev puts two chunks on each rank: stages (chunks) must be even and >= 2, got {stages}")
    ranks = stages // 2
    built = max(microbatches, 2 * ranks)
    rows, overlapped = [], []
    for r in range(ranks):
        actions, pairs = _rank_actions(ranks, built, r)
        rows.append(tuple(a for a in actions if a.microbatch < microbatches))
        overlapped += [pair for pair in pairs if all(a.microbatch < microbatches for a in pair)]
    return Schedule("dualpipev", stages, microbatches, v_placement(stages), tuple(rows), overlapped=tuple(overlapped))


def dualpipe(stages: int, microbatches: int) -> Schedule:
    """Bidirectional DualPipe on ``stages`` ranks, two copies of the pipeline (see the module
    docstring)."""
    if stages < 2 or stages % 2:
        raise ValueError(
            f"dualpipe puts stage s and stage p-1-s on rank s, DeepSeek's phases need an even number of "
            f"stages (ranks), got {stages}; use dualpipev, or an even stage count"
        )
    if microbatches < 2:
        raise ValueError(
            f"dualpipe splits the microbatches between its two directions: it needs at least 2, got {microbatches}"
        )
    down = (microbatches + 1) // 2  # copy 0's share; copy 1 runs microbatches down..m-1
    shares = (down, microbatches - down)
    built = max(down, stages)
    rows = []
    for rank in range(stages):
        row = []
        for a in _rank_actions(stages // 2, built, min(rank, stages - 1 - rank))[0]:
            copy = 0 if a.stage == rank else 1  # copy 0 runs stage s on rank s
            if a.microbatch < shares[copy]:
                row.append(Action(a.stage, a.kind, a.microbatch + copy * down))
        rows.append(tuple(row))
    return Schedule("dualpipe", stages, microbatches, in_line(stages), tuple(rows), mirrored_from=down)
