"""The schedule IR: actions, per-rank programs, their text, grid and CSV forms.

The text form is torch.distributed.pipelining's: ``"<stage><kind><microbatch>"``, e.g. ``"0F3"``
(forward of microbatch 3 on stage 0), ``"2I1"`` (input-gradient backward), ``"2W1"`` (weight-gradient
backward), ``"1B0"`` (fused backward), ``"1SEND_F3"`` / ``"2RECV_F3"`` (communication). A SEND names the
stage that sends, a RECV the stage that receives. The CSV form is torch's: one row per rank, one
cell per action, in execution order. Its composite cell ``"(0F7;7B3)OVERLAP_F_B"`` (DualPipeV's
forward of one microbatch computed while another's backward runs) is read as its actions in
order, remembered in ``Schedule.overlapped`` and written back as one cell. Cells for what this
project's runtime decides itself are read and left out (``IGNORED_KINDS``: FSDP's
``UNSHARD``/``RESHARD``, data parallelism's ``REDUCE_GRAD``), counted in ``info["ignored_actions"]``.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence


class ActionKind(str, enum.Enum):
    """What an action does, as torch's `_ComputationType` names it: F forward, I input-gradient
    backward (the paper's B), W weight-gradient backward, B fused backward (I then W at once),
    and the messages SEND_F/RECV_F (activations) and SEND_B/RECV_B (gradients). A `str` whose
    value is its letters in the text form, so ``"0F3"`` and the CSV form read and write as they
    are and a kind equals its text (``ActionKind.F == "F"``)."""

    F = "F"
    I = "I"  # noqa: E741 - the schedule format's letter
    W = "W"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


COMPUTE_KINDS = (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B)
COMM_KINDS = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
KINDS = COMPUTE_KINDS + COMM_KINDS
_KIND_OF_TEXT = {kind.value: kind for kind in ActionKind}

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")
# torch's kinds for parameter sharding and gradient reduction: the runtime places those itself
IGNORED_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_IGNORED_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")
OVERLAP_KIND = "OVERLAP_F_B"  # torch's composite: its sub-actions may run at once
_COMPOSITE_RE = re.compile(r"^\((.*)\)(\w+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` (an `ActionKind`; its text is taken too) of ``microbatch`` on
    ``stage``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        kind = _KIND_OF_TEXT.get(self.kind) if isinstance(self.kind, str) else None
        if kind is None:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {[str(k) for k in KINDS]}")
        object.__setattr__(self, "kind", kind)
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
                f"with kind one of {[str(k) for k in KINDS]}"
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

    ``overlapped``: groups of compute actions that follow each other on a rank and that torch's
    format writes as one ``OVERLAP_F_B`` cell (DualPipeV: a forward beside another microbatch's
    backward). The runtime runs a group's actions one after the other, in order; the groups
    only change how ``to_csv`` writes them.
    """

    name: str
    stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    info: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    mirrored_from: int | None = None
    overlapped: tuple[tuple[Action, ...], ...] = field(default=(), compare=False, hash=False)

    def __post_init__(self) -> None:
        def parsed(rows: Iterable[Iterable[Action | str]]) -> tuple[tuple[Action, ...], ...]:
            return tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in rows)

        object.__setattr__(self, "stage_to_rank", tuple(int(r) for r in self.stage_to_rank))
        object.__setattr__(self, "actions", parsed(self.actions))
        object.__setattr__(self, "info", dict(self.info))
        object.__setattr__(self, "overlapped", parsed(self.overlapped))
        if len(self.stage_to_rank) != self.stages:
            raise ValueError(
                f"schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries for {self.stages} stages"
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
        """torch's CSV: one row per rank (torch loads it with ``_load_csv``); an ``overlapped``
        group whose actions follow each other in a row is one ``(a;b)OVERLAP_F_B`` cell."""
        starts = {group[0]: group for group in self.overlapped}
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for row in self.actions:
            cells, i = [], 0
            while i < len(row):
                group = starts.get(row[i])
                if group is not None and tuple(row[i : i + len(group)]) == group:
                    cells.append(f"({';'.join(map(str, group))}){OVERLAP_KIND}")
                    i += len(group)
                else:
                    cells.append(str(row[i]))
                    i += 1
            writer.writerow(cells)
        return buffer.getvalue()

    @classmethod
    def from_csv(
        cls, text: str, name: str = "csv", stages: int | None = None, microbatches: int | None = None,
    ) -> "Schedule":
        """Parse torch's CSV form, compute-only or with communication (every cell torch writes:
        see the module docstring); stage count, microbatch count and placement are inferred
        unless given. A cell that is none of these raises ValueError naming its rank and column."""
        rows: list[list[Action]] = []
        overlapped: list[tuple[Action, ...]] = []
        ignored: dict[str, int] = {}
        for rank, row in enumerate(csv.reader(io.StringIO(text))):
            actions: list[Action] = []
            for column, cell in enumerate(row):
                try:
                    parsed, overlap, skipped = _parse_cell(cell)
                except ValueError as error:
                    raise ValueError(
                        f"schedule {name!r}, rank {rank} (row {rank + 1}), column {column + 1}: {error}"
                    ) from None
                actions += parsed
                if overlap:
                    overlapped.append(tuple(parsed))
                if skipped:
                    ignored[skipped] = ignored.get(skipped, 0) + 1
            rows.append(actions)
        schedule = cls.from_rows(rows, name=name, stages=stages, microbatches=microbatches, overlapped=overlapped)
        return schedule.with_info(ignored_actions=ignored) if ignored else schedule

    @classmethod
    def from_rows(
        cls, rows: Sequence[Iterable[Action | str]], name: str = "custom", stages: int | None = None,
        microbatches: int | None = None, overlapped: Sequence[Sequence[Action]] = (),
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
                if a.is_compute and placement.setdefault(a.stage, rank) != rank:
                    raise ValueError(
                        f"stage {a.stage} appears on ranks {placement[a.stage]} and {rank}; "
                        "each stage must run on exactly one rank"
                    )
        missing = [s for s in range(stages) if s not in placement]
        if missing:
            raise ValueError(f"stages {missing} have no compute action, so their rank is unknown")
        groups = tuple(tuple(group) for group in overlapped)
        return cls(
            name, stages, microbatches, tuple(placement[s] for s in range(stages)), tuple(parsed), overlapped=groups
        )


def _parse_cell(cell: str) -> tuple[list[Action], bool, str | None]:
    """One cell of torch's CSV: (its actions, whether they are an OVERLAP_F_B group, the kind of
    an ignored cell or None). Empty cells have no action."""
    text = cell.strip()
    if not text:
        return [], False, None
    ignored = _IGNORED_RE.match(text)
    if ignored:
        return [], False, ignored.group(1)
    composite = _COMPOSITE_RE.match(text)
    if composite is None:
        return [Action.parse(text)], False, None
    inner, kind = composite.groups()
    if kind != OVERLAP_KIND:
        raise ValueError(
            f"cannot parse action {text!r}: the only composite action is '(<action>;<action>){OVERLAP_KIND}'"
        )
    parts = [Action.parse(part) for part in inner.split(";") if part.strip()]
    if len(parts) < 2 or not all(a.is_compute for a in parts):
        raise ValueError(
            f"cannot parse action {text!r}: {OVERLAP_KIND} groups two or more compute actions, such as "
            f"'(0F7;7B3){OVERLAP_KIND}'"
        )
    return parts, True, None


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
