"""The schedule IR: actions, per-rank programs, their text, grid and CSV forms.

The text form is torch.distributed.pipelining's: ``"<stage><kind><microbatch>"``, e.g. ``"0F3"``
(forward of microbatch 3 on stage 0), ``"2I1"`` (input-gradient backward), ``"2W1"`` (weight-gradient
backward), ``"1B0"`` (fused backward), ``"1SEND_F3"`` / ``"2RECV_F3"`` (communication). A SEND names the
stage that sends, a RECV the stage that receives. The CSV form is torch's "compute_only" format:
one row per rank, one cell per action, in execution order.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

COMPUTE_KINDS = ("F", "I", "W", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` of ``microbatch`` on ``stage``.

    Kinds: F forward, I input-gradient backward (the paper's B), W weight-gradient backward,
    B fused backward (I then W at once), and the communication kinds SEND_F/RECV_F/SEND_B/RECV_B.
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"action stage must be a non-negative int, got {self.stage!r}")
        if not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"action microbatch must be a non-negative int, got {self.microbatch!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str()``: ``Action.parse("1SEND_B2") == Action(1, "SEND_B", 2)``."""
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> such as '0F3' "
                f"with kind one of {KINDS}"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), kind, int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """Per-rank programs. ``actions[r]`` is rank r's list in execution order.

    ``stages`` counts pipeline stages (chunks, for schedules that put several on one rank);
    ``stage_to_rank[s]`` is the rank that runs stage s. ``info`` carries provenance such as the
    solver status, its proven lower bound and the solve time.

    ``mirrored_from`` (None: a single copy): the pipeline exists twice, and microbatches from
    that index on run on the mirrored copy, which puts stage s on rank ``ranks - 1 -
    stage_to_rank[s]`` (DualPipe). ``rank_of(stage, microbatch)`` is where an action runs.
    """

    name: str
    stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    info: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    mirrored_from: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(
            self,
            "actions",
            tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in self.actions),
        )
        object.__setattr__(self, "info", dict(self.info))
        if len(self.stage_to_rank) != self.stages:
            raise ValueError(
                f"schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries "
                f"for {self.stages} stages"
            )
        if self.mirrored_from is not None and not 0 < self.mirrored_from < self.microbatches:
            raise ValueError(
                f"schedule {self.name!r}: mirrored_from={self.mirrored_from} must split the {self.microbatches} "
                "microbatches between the two copies (0 < mirrored_from < microbatches)"
            )

    @property
    def ranks(self) -> int:
        return len(self.actions)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``stage`` for ``microbatch`` (the mirrored copy's from ``mirrored_from`` on)."""
        rank = self.stage_to_rank[stage]
        if self.mirrored_from is not None and microbatch >= self.mirrored_from:
            return self.ranks - 1 - rank
        return rank

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The ranks that run ``stage``: its own, then its mirrored copy's where that is another."""
        rank = self.stage_to_rank[stage]
        if self.mirrored_from is None or self.ranks - 1 - rank == rank:
            return (rank,)
        return (rank, self.ranks - 1 - rank)

    def stages_on(self, rank: int) -> list[int]:
        """The stages ``rank`` runs (for some microbatch), in stage order."""
        return [s for s in range(self.stages) if rank in self.ranks_of(s)]

    @property
    def placement(self) -> tuple[tuple[int, ...], int | None]:
        """What decides where every action runs: two schedules with the same placement run each
        (stage, microbatch) on the same rank."""
        return self.stage_to_rank, self.mirrored_from

    @property
    def is_lowered(self) -> bool:
        return any(not a.is_compute for row in self.actions for a in row)

    def compute_only(self) -> "Schedule":
        """The same schedule without communication actions."""
        rows = tuple(tuple(a for a in row if a.is_compute) for row in self.actions)
        return replace(self, actions=rows)

    def with_info(self, **info: Any) -> "Schedule":
        return replace(self, info={**self.info, **info})

    def rows_as_text(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self.actions]

    def grid(self) -> str:
        """Step-by-rank table in the layout of torch's ``_format_pipeline_order``."""
        return format_grid(self.rows_as_text())

    def to_csv(self) -> str:
        """torch's compute-only CSV: one row per rank (load with ``_load_csv``)."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for row in self.rows_as_text():
            writer.writerow(row)
        return buffer.getvalue()

    @classmethod
    def from_csv(
        cls,
        text: str,
        name: str = "csv",
        stages: int | None = None,
        microbatches: int | None = None,
    ) -> "Schedule":
        """Parse torch's CSV form; stage count, microbatch count and placement are inferred."""
        rows = [[Action.parse(cell) for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
        return cls.from_rows(rows, name=name, stages=stages, microbatches=microbatches)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Iterable[Action | str]],
        name: str = "custom",
        stages: int | None = None,
        microbatches: int | None = None,
    ) -> "Schedule":
        """Build a schedule from per-rank action lists (Actions or their text)."""
        parsed = [tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in rows]
        all_actions = [a for row in parsed for a in row]
        if not all_actions:
            raise ValueError("a schedule needs at least one action")
        stages = stages if stages is not None else 1 + max(a.stage for a in all_actions)
        microbatches = microbatches if microbatches is not None else 1 + max(a.microbatch for a in all_actions)
        placement: dict[int, int] = {}
        for rank, row in enumerate(parsed):
            for a in row:
                if a.is_compute:
                    if placement.setdefault(a.stage, rank) != rank:
                        raise ValueError(
                            f"stage {a.stage} appears on ranks {placement[a.stage]} and {rank}; "
                            "each stage must run on exactly one rank"
                        )
        missing = [s for s in range(stages) if s not in placement]
        if missing:
            raise ValueError(f"stages {missing} have no compute action, so their rank is unknown")
        return cls(name, stages, microbatches, tuple(placement[s] for s in range(stages)), tuple(parsed))


def format_grid(rows: Sequence[Sequence[str]], title: str = "Rank") -> str:
    """Format per-rank columns of cells as a 'Step i: ...' table (torch's layout)."""
    steps = max((len(r) for r in rows), default=0)
    step_labels = [f"Step {str(i).zfill(len(str(max(steps - 1, 0))))}" for i in range(steps)]
    label_width = max((len(s) for s in step_labels), default=4)
    headers = [f"{title} {r}" for r in range(len(rows))]
    widths = [max([len(h)] + [len(c) for c in col]) for h, col in zip(headers, rows)]
    lines = [" " * (label_width + 2) + " ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for i, label in enumerate(step_labels):
        cells = [(col[i] if i < len(col) else "").ljust(w) for col, w in zip(rows, widths)]
        lines.append(f"{label}: " + " ".join(cells).rstrip())
    return "\n".join(lines) + "\n"
