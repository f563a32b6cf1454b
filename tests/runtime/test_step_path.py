"""The path of a step to its first send is as short as docs/architecture.md says: the number of
zbcompile files a profiled second step on rank 0 of a two-rank run enters before its first
point-to-point send equals the number in the doc's heading."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import launches

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented_files() -> int:
    found = re.search(r"^## A step's path to its first send \((\d+) library files\)$", DOC.read_text(), re.M)
    if found is None:
        raise ValueError("docs/architecture.md has no heading \"## A step's path to its first send (N library files)\"")
    return int(found.group(1))


def test_the_documented_heading_is_read():
    assert documented_files() > 0


@launches.READS_TWO_RANKS
def test_a_step_reaches_its_first_send_through_the_documented_files():
    files, sent = launches.two_rank_results("step_path")[0]  # the shared two-rank launch runs it first
    assert sent and files[0] == "api.py"
    assert len(files) == documented_files(), (
        f"a step enters {len(files)} library files before its first send ({files}); docs/architecture.md "
        f"says {documented_files()}: shorten the path or update the doc"
    )
