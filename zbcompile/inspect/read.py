"""A dump read back: where its files are (the layout `inspect.write` writes) and `load`, which
turns a dump directory into a `Dump` (its compile record, schedule versions and measured
trace). Pure Python: reads JSON and text, imports no torch."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from zbcompile.inspect.timelines import load_trace

COMPILE_FILE = "compile.json"
SCHEDULE_FILE = "schedule.json"
FORWARD_FILE = "forward.py"
GRAPH_FILES = {"F": "F.py", "I": "I.py", "W": "W.py", "B": "B.py"}  # by action letter; B: the fused backward
GRAPHS = (*GRAPH_FILES, "forward")


@dataclass(frozen=True)
class Dump:
    """One compile's record (`compile.json`), its schedule versions (`schedule.json`) and the
    measured trace (None when nothing ran distributed yet)."""

    directory: str | None
    record: dict[str, Any]
    versions: list[dict[str, Any]]
    trace: dict[str, Any] | None


def stage_dir(directory: str, stage: int) -> str:
    return os.path.join(directory, f"stage{stage}")


def compile_dir(path: str) -> str:
    """`path` itself when it holds a compile, else its newest `compile-<n>`."""
    if os.path.exists(os.path.join(path, COMPILE_FILE)):
        return path
    found = []
    if os.path.isdir(path):
        for name in os.listdir(path):
            match = re.fullmatch(r"compile-(\d+)", name)
            if match and os.path.exists(os.path.join(path, name, COMPILE_FILE)):
                found.append((int(match.group(1)), name))
    if not found:
        raise ValueError(
            f"{path} is not a zbcompile dump: it has no {COMPILE_FILE} and no compile-<n> directory with one. "
            "Write one with ZBCOMPILE_DUMP=DIR or pipeline(..., dump_dir=DIR)."
        )
    return os.path.join(path, max(found)[1])


def load(path: str) -> Dump:
    """Read a dump; rank timelines are merged into `trace.json` on the way."""
    directory = compile_dir(path)
    with open(os.path.join(directory, COMPILE_FILE)) as f:
        record = json.load(f)
    with open(os.path.join(directory, SCHEDULE_FILE)) as f:
        versions = json.load(f)["versions"]
    return Dump(directory, record, versions, load_trace(directory))


def graph_text(dump: Dump, stage: int | None, graph: str) -> str:
    """The code of one graph: `graph` in F, I, W, backward (of `stage`) or forward (the traced
    forward with every node's stage)."""
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; choose one of {', '.join(GRAPHS)}")
    if graph == "forward":
        path = os.path.join(dump.directory, FORWARD_FILE)
    else:
        stages = dump.record["stages"]
        if stage is None or not 0 <= stage < stages:
            raise ValueError(
                f"--graph {graph} needs --stage between 0 and {stages - 1} (this pipeline has {stages} stages), got "
                f"{stage}"
            )
        path = os.path.join(stage_dir(dump.directory, stage), GRAPH_FILES[graph])
    with open(path) as f:
        return f.read()
