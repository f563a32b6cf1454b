"""Runs a script as `__main__` (`python exit_check.py SCRIPT ARGS...`, e.g. under torchrun) and,
as the last thing before Python finalizes (the first exit hook registered runs last), prints
which threads that could abort the process are still alive: gloo's worker threads
(`pt_gloo_runloop`, `gloo_tcp_loop`, which take the GIL to free a collective's tensors) and the
pipeline's transport helpers (`zbcompile-send`, `zbcompile-arrival`). A thread in C++ code when
Python finalizes is killed there ("terminate called without an active exception"), so a clean
exit needs none left:

    exit check, rank 1: no threads left
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

WATCHED = ("pt_gloo_runloop", "gloo_tcp_loop", "zbcompile-send", "zbcompile-arrival")


def threads_left() -> list[str]:
    """The names of this process's watched threads still alive (as the kernel names them)."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # ended meanwhile
            continue
    return sorted(name for name in names if name in WATCHED)


def report() -> None:
    left = threads_left()
    where = f"exit check, rank {os.environ.get('RANK', '0')}"
    print(f"{where}: threads left: {', '.join(left)}" if left else f"{where}: no threads left", flush=True)


if __name__ == "__main__":
    atexit.register(report)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")
