"""What each rank runs in the torch.distributed.pipelining interop test: the example's step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import pipelining_interop  # noqa: E402


def pipelined_steps(schedules: list[str]) -> dict:
    return {schedule: pipelining_interop.pipelined_step(schedule) for schedule in schedules}
