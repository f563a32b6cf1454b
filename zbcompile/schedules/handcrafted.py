"""Handcrafted schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2.

Each generator returns per-rank compute-only programs. Stage s of a single-chunk pipeline runs on
rank s. Shapes (p stages, m microbatches, stage s counted from 0):

- GPipe: all F, then all B.
- 1F1B: min(p-1-s, m) warm-up F, then (F, B) pairs, then the remaining B.
- ZB-H1: 1F1B's order with B split into I and W; stage s holds back its first s W passes so that
  they fill the drain. Peak memory p M_B; bubble (p-1)(T_F + T_B - T_W).
- ZB-H2: 2(p-1-s)+1 warm-up F, then (I, W, F) triples in which stage s leaves out its last 2s W
  passes, then (I, W) pairs, then the held-back W. Peak memory (2p-1) M_B; bubble
  (p-1)(T_F + T_B - 2 T_W) when T_F + T_B >= 2 T_W.

Peaks per stage with M_W possibly above M_B (e = max(0, M_W - M_B), what an I adds; a fused B
counts its I part), derived and tested in ``tests/schedules/test_schedule_memory.py``:
1F1B min(p-s, m) M_B + e; GPipe m M_B + e; ZB-H1 (m >= p) (p-s) M_B + s M_W + e, at most
p max(M_B, M_W); ZB-H2 w M_B + h M_W + e with w = min(2(p-1-s)+1, m), h = min(2s, m-w), at most
(2p-1) max(M_B, M_W).
- Interleaved 1F1B (Megatron-LM's): v chunks per rank, stage c*P + r on rank r.
"""

from __future__ import annotations

from .ir import Action, Schedule


def in_line(stages: int) -> tuple[int, ...]:
    """One stage per rank: stage s on rank s."""
    return tuple(range(stages))


def round_robin(stages: int, ranks: int) -> tuple[int, ...]:
    """Chunks dealt out in turn: stage c*ranks + r on rank r (interleaved 1F1B)."""
    return tuple(s % ranks for s in range(stages))


def v_placement(stages: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: stage s on rank s for the first half, 2p-1-s for the second."""
    ranks = stages // 2
    return tuple(s if s < ranks else stages - 1 - s for s in range(stages))


def _single_chunk(name: str, stages: int, microbatches: int, rows: list[list[Action]]) -> Schedule:
    return Schedule(name, stages, microbatches, in_line(stages), tuple(tuple(r) for r in rows))


def gpipe(stages: int, microbatches: int) -> Schedule:
    rows = [
        [Action(s, "F", k) for k in range(microbatches)] + [Action(s, "B", k) for k in range(microbatches)]
        for s in range(stages)
    ]
    return _single_chunk("gpipe", stages, microbatches, rows)


def _one_f_one_b_warmup(stages: int, stage: int, microbatches: int) -> int:
    """1F1B's (and ZB-H1's) warm-up forwards on ``stage``: p-1-s, at most m."""
    return min(stages - 1 - stage, microbatches)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    rows = []
    for s in range(stages):
        warmup = _one_f_one_b_warmup(stages, s, microbatches)
        row = [Action(s, "F", k) for k in range(warmup)]
        for i in range(microbatches - warmup):
            row += [Action(s, "F", warmup + i), Action(s, "B", i)]
        row += [Action(s, "B", k) for k in range(microbatches - warmup, microbatches)]
        rows.append(row)
    return _single_chunk("1f1b", stages, microbatches, rows)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    rows = []
    for s in range(stages):
        warmup = _one_f_one_b_warmup(stages, s, microbatches)
        held_back = min(s, microbatches)
        row = [Action(s, "F", k) for k in range(warmup)]
        next_w = 0
        for i in range(microbatches):
            if warmup + i < microbatches:
                row.append(Action(s, "F", warmup + i))
            row.append(Action(s, "I", i))
            if i >= held_back:
                row.append(Action(s, "W", next_w))
                next_w += 1
        row += [Action(s, "W", k) for k in range(next_w, microbatches)]
        rows.append(row)
    return _single_chunk("zb-h1", stages, microbatches, rows)


def zb_h2(stages: int, microbatches: int) -> Schedule:
    rows = []
    for s in range(stages):
        warmup = min(2 * (stages - 1 - s) + 1, microbatches)
        steady = microbatches - warmup
        held_back = min(2 * s, steady)  # W passes moved to the tail: the parallelogram's corner
        row = [Action(s, "F", k) for k in range(warmup)]
        next_w = 0
        for i in range(steady):
            row.append(Action(s, "I", i))
            if i < steady - held_back:
                row.append(Action(s, "W", next_w))
                next_w += 1
            row.append(Action(s, "F", warmup + i))
        for i in range(steady, microbatches):
            row += [Action(s, "I", i), Action(s, "W", next_w)]
            next_w += 1
        row += [Action(s, "W", k) for k in range(next_w, microbatches)]
        rows.append(row)
    return _single_chunk("zb-h2", stages, microbatches, rows)


def _looped_ranks(name: str, stages: int, ranks: int | None) -> int:
    """The ranks a looped placement spreads ``stages`` chunks over (default two chunks per rank);
    ValueError unless they divide evenly."""
    ranks = ranks if ranks is not None else stages // 2
    if ranks < 1 or stages % ranks:
        raise ValueError(
            f"{name}: {stages} stages (chunks) cannot be spread evenly over {ranks} ranks; "
            "use a multiple of the rank count (default: two chunks per rank, so an even stage count)"
        )
    return ranks


def interleaved_one_f_one_b(stages: int, microbatches: int, ranks: int | None = None) -> Schedule:
    """Megatron-LM's interleaved 1F1B; ``stages`` counts chunks, default two chunks per rank."""
    ranks = _looped_ranks("interleaved-1f1b", stages, ranks)
    chunks = stages // ranks
    if microbatches % ranks:
        raise ValueError(
            f"interleaved-1f1b needs microbatches to be a multiple of the rank count: got "
            f"{microbatches} microbatches for {ranks} ranks; use {ranks * max(1, -(-microbatches // ranks))}"
        )
    total = microbatches * chunks

    def forward_slot(k: int, r: int) -> Action:
        chunk = (k // ranks) % chunks
        return Action(chunk * ranks + r, "F", (k // (ranks * chunks)) * ranks + k % ranks)

    def backward_slot(k: int, r: int) -> Action:
        chunk = chunks - 1 - (k // ranks) % chunks
        return Action(chunk * ranks + r, "B", (k // (ranks * chunks)) * ranks + k % ranks)

    rows = []
    for r in range(ranks):
        warmup = min((ranks - r - 1) * 2 + (chunks - 1) * ranks, total)
        row = [forward_slot(k, r) for k in range(warmup)]
        for i in range(total - warmup):
            row += [forward_slot(warmup + i, r), backward_slot(i, r)]
        row += [backward_slot(k, r) for k in range(total - warmup, total)]
        rows.append(row)
    return Schedule("interleaved-1f1b", stages, microbatches, round_robin(stages, ranks), tuple(tuple(r) for r in rows))


def zb_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024), handcrafted.

    p = stages / 2 ranks; rank r holds chunk 0 = stage r and chunk 1 = stage 2p-1-r (a V: the
    forward goes down the ranks and back up, so the loss is on rank 0). Per rank, with "I" the
    input-gradient backward, in the order of the paper's Figure:
      warm-up   2(p-r)-1 F of chunk 0; r x (F chunk 1, F chunk 0); (p-r) x (F, I, W of chunk 1);
      steady    (F chunk 0 while any are left, I chunk 0, W chunk 0, F chunk 1, I chunk 1, W chunk 1);
      cool-down r x (I chunk 0, I chunk 1); (p-r) x (I chunk 0, W chunk 0); the remaining W of
                chunk 1, then of chunk 0.
    With T_F = T_B = T_W per chunk, no communication delay and m >= 2p every rank's own span has no
    gap (stage bubble rate 0) and the peak memory per rank is 2p chunk activations, i.e. p M_B when
    a chunk holds M_B / 2: 1F1B's peak. When M_W > M_B the W this order defers can exceed that;
    ``heuristic.zbv`` then runs them earlier (``row_edits.make_room``). The order is built for
    max(m, 2p-1) microbatches and the extra ones are dropped, which keeps it valid for small m.
    """
    if stages < 2 or stages % 2:
        raise ValueError(f"zbv puts two chunks on each rank: stages (chunks) must be even and >= 2, got {stages}")
    p = stages // 2
    m = max(microbatches, 2 * p - 1)
    rows = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        row: list[Action] = []
        count = {(stage, kind): 0 for stage in (down, up) for kind in "FIW"}

        def put(stage: int, kinds: str) -> None:
            """The next microbatch of ``stage`` for each of ``kinds`` in turn."""
            for kind in kinds:
                row.append(Action(stage, kind, count[(stage, kind)]))
                count[(stage, kind)] += 1

        for _ in range(2 * (p - r) - 1):
            put(down, "F")
        for _ in range(r):
            put(up, "F")
            put(down, "F")
        for _ in range(p - r):
            put(up, "FIW")
        while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < m:
            if count[(down, "F")] < m:
                put(down, "F")
            put(down, "IW")
            put(up, "FIW")
        for _ in range(r):
            put(down, "I")
            put(up, "I")
        for _ in range(p - r):
            put(down, "IW")
        while count[(up, "W")] < count[(up, "I")]:
            put(up, "W")
        while count[(down, "W")] < count[(down, "I")]:
            put(down, "W")
        rows.append(tuple(a for a in row if a.microbatch < microbatches))
    return Schedule("zbv", stages, microbatches, v_placement(stages), tuple(rows))


def looped_bfs(stages: int, microbatches: int, ranks: int | None = None) -> Schedule:
    """torch.distributed.pipelining's LoopedBFS: looped placement (stage c*P + r on rank r, like
    interleaved 1F1B); each rank runs every microbatch's forward on its chunks in order, then
    every backward (fused B) on its chunks in reverse order. torch runs a chunk's backwards from
    the last microbatch down; here they run in increasing microbatch order, the order every other
    schedule accumulates weight gradients in, so gradients are bitwise the same."""
    ranks = _looped_ranks("looped-bfs", stages, ranks)
    rows = []
    for r in range(ranks):
        own = list(range(r, stages, ranks))
        row = [Action(s, "F", k) for s in own for k in range(microbatches)]
        row += [Action(s, "B", k) for s in reversed(own) for k in range(microbatches)]
        rows.append(tuple(row))
    return Schedule("looped-bfs", stages, microbatches, round_robin(stages, ranks), tuple(rows))
