"""A rank dies mid-step under `torchrun --max-restarts=1`: the survivor fails at once with an
error naming it, torchrun restarts both ranks, and the run resumes from its latest complete
checkpoint to the uninterrupted run's bits (`helpers/torchrun_resume.py`)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import torch

from helpers import torchrun_resume

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _log(logs: str, attempt: int, rank: int, stream: str) -> str:
    paths = glob.glob(os.path.join(logs, "**", f"attempt_{attempt}", str(rank), f"{stream}.log"), recursive=True)
    assert len(paths) == 1, (attempt, rank, stream, paths)
    with open(paths[0]) as f:
        return f.read()


def test_a_rank_killed_mid_step_restarts_from_the_latest_checkpoint_bitwise(tmp_path):
    logs = str(tmp_path / "logs")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        "--monitor-interval=2", f"--log-dir={logs}", "--redirects=3", torchrun_resume.__file__, str(tmp_path),
    ]
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), "OMP_NUM_THREADS": "1",
        # restarted workers must not find the first attempt's addresses in the agent's store (README.md)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    survivor = _log(logs, 0, 0, "stderr")
    pattern = rf"rank 0 failed in step {torchrun_resume.KILLED_AT} after ([0-9.]+) s: PeerError: (.*)"
    failure = re.search(pattern, survivor)
    assert failure, survivor[-3000:]
    assert float(failure[1]) < 60, failure[0]  # the pipeline's timeout: a dead peer's socket fails at once
    assert "with rank 1 (peer rank 1 may have died" in failure[2], failure[0]
    step = torchrun_resume.KILLED_AT // torchrun_resume.CHECKPOINT_EVERY * torchrun_resume.CHECKPOINT_EVERY
    for rank in range(2):
        assert f"rank {rank}: attempt 1 resumed from step_{step}" in _log(logs, 1, rank, "stdout")
        uninterrupted, resumed = (
            torch.load(tmp_path / f"{run}{rank}.pt", weights_only=False) for run in ("uninterrupted", "resumed")
        )
        for part in ("params", "optimizer"):
            assert uninterrupted[part].keys() == resumed[part].keys()
            for name, value in uninterrupted[part].items():
                other = resumed[part][name]
                same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                assert same, f"rank {rank}: {part} {name}"
