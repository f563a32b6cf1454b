"""The backward before and after the I/W split, as text (`split_diff`, what `zbcompile inspect
--diff` and the report print), read from a dump's graph code. Pure Python; no torch."""

from __future__ import annotations

import itertools
import re

from zbcompile.inspect.read import Dump, graph_text

_ASSIGNMENT = re.compile(r'^\s+(\w+)(?:: "[^"]*")? = (.*?)(\s+#.*)?$')


def _operations(code: str) -> dict[str, str]:
    """Node name -> its right-hand side, in graph order, from `inspect.write.readable_code` output."""
    ops = {}
    for line in code.splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            ops[match.group(1)] = match.group(2).replace("torch.ops.", "")
    return ops


def _returns(code: str) -> list[str]:
    """The environment names a graph returns, from its code's header."""
    lines = code.splitlines()
    after = lines[lines.index("# returns, in order:") + 1 :]
    names = [
        line.removeprefix("#").strip() for line in itertools.takewhile(lambda line: line.startswith("#   "), after)
    ]
    return [n for n in names if n != "(nothing)"]


def split_diff(dump: Dump, stage: int | None = None) -> str:
    """Per stage, every operation of the unsplit backward marked with where it went (I, W or
    both: recomputed), operations I or W compute differently (a fused op asked for part of its
    outputs), the ones they add (W's copy of such an op, which takes over outputs of the
    original) and what each returns."""
    stages = range(dump.record["stages"]) if stage is None else [stage]
    blocks = []
    for s in stages:
        code = {g: graph_text(dump, s, g) for g in ("B", "I", "W")}
        ops = {g: _operations(text) for g, text in code.items()}
        whole, i, w = ops["B"], ops["I"], ops["W"]
        lines = [
            f"stage {s}: the backward ({len(whole)} ops) split into I ({len(i)} ops) and W ({len(w)} ops)",
            "  I W  op",
        ]
        added = [
            (g, name, rhs)
            for g, graph_ops in (("I", i), ("W", w))
            for name, rhs in graph_ops.items()
            if name not in whole
        ]
        for name, rhs in whole.items():
            mark = f"  {'I' if name in i else ' '} {'W' if name in w else ' '}"
            if name not in i and name not in w:
                mark = "  - -"
                rhs += "  (in neither: computed by an added copy below)" if added else "  (in neither: unused)"
            lines.append(f"{mark}  {name} = {rhs}")
            for g, graph_ops in (("I", i), ("W", w)):
                if name in graph_ops and graph_ops[name].replace("stash_", "") != rhs:
                    lines.append(f"         {g} computes: {graph_ops[name]}")
        for g, name, rhs in added:
            lines.append(f"  +{g}   {name} = {rhs}  (not in the unsplit backward)")
        for g in ("I", "W"):
            lines.append(f"  {g} returns: {', '.join(_returns(code[g])) or '(nothing)'}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
