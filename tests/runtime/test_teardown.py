"""Processes that build and drop pipelines leave cleanly: exit code 0, even when a gloo helper
thread still waits for a message as the interpreter exits (`transport.py`'s exit hook stops them)."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.multiprocess import free_port

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "teardown_worker.py")


def test_twenty_two_rank_pipelines_start_and_tear_down_with_exit_code_zero():
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), str(port), "20"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outcomes = []
    for process in ranks:
        try:
            out, err = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        outcomes.append((process.returncode, out, err))
    for rank, (code, out, err) in enumerate(outcomes):
        assert code == 0 and "terminate called" not in err, f"rank {rank} exited with {code}:\n{out}\n{err[-3000:]}"
        assert f"rank {rank}: 20 pipelines done" in out
