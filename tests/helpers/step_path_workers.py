"""What each rank runs in tests/runtime/test_step_path.py: the library files a step passes
through on its way to the first point-to-point send."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

import zbcompile
from helpers.models import build

LIBRARY = os.path.dirname(os.path.abspath(zbcompile.__file__))
SEND_FILE = os.path.join(LIBRARY, "runtime", "step", "transport.py")


def files_before_first_send(stages: int = 2, microbatches: int = 4) -> tuple[list[str], bool] | None:
    """Rank 0's zbcompile files (relative to the package, in order of first entry) that the
    second `step()` enters up to the first `Transport.send`, with `sys.setprofile`, and whether
    that send was reached; other ranks: None. The first step compiles; the second is the steady path."""
    case = build("mlp")
    pipe = zbcompile.pipeline(
        case.model, stages=stages, microbatches=microbatches, loss_fn=case.loss_fn, schedule="1f1b", timeout=60
    )
    case.step(pipe)
    entered: list[str] = []
    sent = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(LIBRARY + os.sep):
            return
        if path == SEND_FILE and frame.f_code.co_name == "send":
            entered.append("runtime/step/transport.py")
            sent.append(True)
            sys.setprofile(None)
            return
        relative = os.path.relpath(path, LIBRARY)
        if relative not in entered:
            entered.append(relative)

    sys.setprofile(profile if dist.get_rank() == 0 else None)
    try:
        case.step(pipe)
    finally:
        sys.setprofile(None)
    return (list(dict.fromkeys(entered)), bool(sent)) if dist.get_rank() == 0 else None
