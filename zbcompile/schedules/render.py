"""Timeline pictures in the style of the paper's figures: one row per rank, one box per action.

One layout (a list of ``Box``), two renderers: ``to_svg`` (hand-written SVG, one ``<rect>`` per box
with ``data-action``/``class`` naming it and the microbatch number inside) and ``to_png``
(matplotlib, imported lazily). Any timeline can be drawn, e.g. predicted vs measured, by building
``Box`` objects directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence
from xml.sax.saxutils import escape

from .costs import Costs, ResolvedCosts
from .ir import Schedule
from .simulate import simulate

IDLE = "idle"  # the kind of a box that marks a rank's idle time (the bubble)

COLOURS = {"F": "#8fb4e3", "I": "#7fd1c7", "B": "#7fd1c7", "W": "#a8d98a", IDLE: "#f3b6b0"}
_ROW_HEIGHT, _LABEL_WIDTH, _TITLE_HEIGHT = 28, 70, 24
_LEGEND = {
    "F": "F: forward",
    "I": "I: input-gradient backward",
    "B": "B: whole backward",
    "W": "W: weight gradients",
    IDLE: "idle (bubble)",
}


@dataclass(frozen=True)
class Box:
    rank: int
    start: float
    end: float
    label: str  # text inside the box (the microbatch number)
    kind: str  # F, I, W or B: chooses the colour
    action: str = ""  # full action name, kept as an attribute in the SVG


def layout(schedule: Schedule, costs: Costs | ResolvedCosts | None = None) -> list[Box]:
    """Boxes of the simulated timing of ``schedule`` (compute actions only)."""
    sim = simulate(schedule, costs)
    return [
        Box(rank, sim.start[a], sim.end[a], str(a.microbatch), a.kind, str(a))
        for rank, row in enumerate(schedule.actions)
        for a in row
        if a.is_compute
    ]


def idle_boxes(boxes: Sequence[Box], kinds: Sequence[str] = ("F", "I", "B", "W")) -> list[Box]:
    """The bubble: per rank, every gap between its actions of `kinds` from its first start to
    its last end, as boxes of kind ``IDLE`` (no label)."""
    by_rank: dict[int, list[Box]] = {}
    for b in boxes:
        if b.kind in kinds:
            by_rank.setdefault(b.rank, []).append(b)
    gaps = []
    for rank, row in sorted(by_rank.items()):
        row.sort(key=lambda b: b.start)
        reached = row[0].end
        for b in row[1:]:
            if b.start > reached:
                gaps.append(Box(rank, reached, b.start, "", IDLE, "idle"))
            reached = max(reached, b.end)
    return gaps


def to_svg(
    boxes: Sequence[Box], title: str = "", width: float = 1200.0, time_range: tuple[float, float] | None = None,
    legend: bool = False,
) -> str:
    """An SVG document with one ``<rect class="action F" data-action="0F3">`` per box. The x axis
    spans the boxes, or ``time_range`` (to draw several timelines on one scale). ``legend`` adds a
    row naming the colour of each kind drawn (``<rect class="legend F">``)."""
    ranks = 1 + max((b.rank for b in boxes), default=0)
    t0 = min((b.start for b in boxes), default=0.0)
    t1 = max((b.end for b in boxes), default=1.0)
    if time_range is not None:
        t0, t1 = time_range
    xscale = (width - _LABEL_WIDTH - 10) / max(t1 - t0, 1e-12)
    height = _TITLE_HEIGHT + ranks * _ROW_HEIGHT + 10 + (_ROW_HEIGHT if legend else 0)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" font-family="sans-serif">',
        f'<text x="4" y="16" font-size="13">{escape(title)}</text>',
    ]
    for r in range(ranks):
        y = _TITLE_HEIGHT + r * _ROW_HEIGHT
        out.append(f'<text x="4" y="{y + 18}" font-size="12">rank {r}</text>')
    for b in boxes:
        x = _LABEL_WIDTH + (b.start - t0) * xscale
        w = max((b.end - b.start) * xscale, 0.5)
        y = _TITLE_HEIGHT + b.rank * _ROW_HEIGHT
        colour = COLOURS.get(b.kind, "#cccccc")
        stroke = 'stroke="none"' if b.kind == IDLE else 'stroke="#333" stroke-width="0.5"'
        out.append(
            f'<rect class="action {escape(b.kind)}" data-action="{escape(b.action)}" x="{x:.2f}" y="{y + 2}" '
            f'width="{w:.2f}" height="{_ROW_HEIGHT - 4}" fill="{colour}" {stroke}/>'
        )
        font = min(11.0, max(5.0, w * 0.6))
        out.append(
            f'<text x="{x + w / 2:.2f}" y="{y + _ROW_HEIGHT / 2 + 4}" font-size="{font:.1f}" '
            f'text-anchor="middle">{escape(b.label)}</text>'
        )
    if legend:
        out += _svg_legend({b.kind for b in boxes}, _TITLE_HEIGHT + ranks * _ROW_HEIGHT + 8)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_legend(kinds: set[str], y: float) -> list[str]:
    """One swatch and its name per kind in ``kinds``, in ``_LEGEND``'s order, left to right."""
    out, x = [], float(_LABEL_WIDTH)
    for kind, text in _LEGEND.items():
        if kind not in kinds:
            continue
        out.append(
            f'<rect class="legend {escape(kind)}" x="{x:.0f}" y="{y:.0f}" width="14" height="14" '
            f'fill="{COLOURS[kind]}" stroke="#333" stroke-width="0.5"/>'
        )
        out.append(f'<text x="{x + 18:.0f}" y="{y + 11:.0f}" font-size="11">{escape(text)}</text>')
        x += 26 + 6.5 * len(text)
    return out


def to_png(boxes: Sequence[Box], path: str, title: str = "") -> None:
    """The same picture through matplotlib."""
    to_png_panels([(title, boxes)], path, xlabel="time")


def to_png_panels(panels: Sequence[tuple[str, Sequence[Box]]], path: str, xlabel: str = "time") -> None:
    """Several timelines (title, boxes) one above the other on one time axis, through matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [1 + max((b.rank for b in boxes), default=0) for _, boxes in panels]
    fig, axes = plt.subplots(
        len(panels), 1, sharex=True, squeeze=False, figsize=(14, sum(0.45 * r + 0.8 for r in rows) + 0.4),
        gridspec_kw={"height_ratios": [r + 1 for r in rows]},
    )
    for ax, (title, boxes), ranks in zip(axes[:, 0], panels, rows):
        for b in boxes:
            idle = b.kind == IDLE
            ax.barh(
                b.rank,
                b.end - b.start,
                left=b.start,
                height=0.85,
                color=COLOURS.get(b.kind, "#cccccc"),
                edgecolor="none" if idle else "#333",
                linewidth=0.3,
                hatch="///" if idle else None,
                zorder=1 if idle else 2,
            )
            if not idle and ranks <= 16 and len(boxes) <= 2000:
                ax.text((b.start + b.end) / 2, b.rank, b.label, ha="center", va="center", fontsize=5, zorder=3)
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(xlabel)
    kinds = [k for k in _LEGEND if any(b.kind == k for _, boxes in panels for b in boxes)]
    handles = [
        Patch(facecolor=COLOURS[k], edgecolor="#333", linewidth=0.3, hatch="///" if k == IDLE else None) for k in kinds
    ]
    axes[0, 0].legend(
        handles, [_LEGEND[k] for k in kinds], loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
