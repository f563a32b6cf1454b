"""Solve a schedule in a child process while training goes on: `make_schedule` is pure Python
(plus CP-SAT), and run on a thread of the training process it would hold the GIL between the
runtime's operations, slowing every step while it lasts. The child imports only
`zbcompile.schedules` (no torch); the arguments and the schedule travel pickled over its
stdin and stdout.

    python -m zbcompile.runtime.tuning.background_solve   # the child's side
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any


class BackgroundSolve:
    """`make_schedule(**arguments)` in a child process, started at once; `done()` tells without
    blocking whether it has finished, `result()` waits for it."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        package_root = str(Path(__file__).resolve().parents[3])  # the folder holding zbcompile/
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        )
        with tempfile.TemporaryFile() as given:
            pickle.dump(arguments, given)
            given.seek(0)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "zbcompile.runtime.tuning.background_solve"],
                stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            )
        self.started = time.perf_counter()
        self._finalizer = weakref.finalize(self, _stop, self._process)
        self._output: tuple[bytes, bytes] | None = None
        # reads the child's output as it comes (a large schedule would not fit the pipe's buffer)
        self._reader = threading.Thread(target=self._read, name="zbcompile-solve", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        self._output = self._process.communicate()

    def done(self) -> bool:
        return not self._reader.is_alive()

    def wait(self, timeout: float) -> bool:
        """Whether the child has finished, waiting for it up to `timeout` seconds."""
        self._reader.join(timeout)
        return self.done()

    def result(self, timeout: float):
        """The schedule, or raises RuntimeError with the child's error (or after `timeout` seconds)."""
        if not self.wait(timeout):
            self._finalizer()
            raise RuntimeError(f"solving the schedule took over {time.perf_counter() - self.started:.0f} s")
        self._finalizer.detach()
        out, err = self._output
        if self._process.returncode != 0:
            raise RuntimeError(
                f"solving the schedule failed: {(err.decode(errors='replace').strip().splitlines() or ['killed'])[-1]}"
            )
        return pickle.loads(out)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def main() -> None:
    from zbcompile.schedules import make_schedule

    arguments = pickle.loads(sys.stdin.buffer.read())
    schedule = make_schedule(**arguments)
    sys.stdout.buffer.write(pickle.dumps(schedule))


if __name__ == "__main__":
    main()
