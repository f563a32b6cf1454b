"""`zbcompile rehearse` end to end at p = 4, as a user runs it: 1F1B, ZB-H1 and torch's
Schedule1F1B on four local processes, every action taking its emulated time; the record (each
schedule's measured step beside the simulator's prediction) and the timelines written. How close
measured comes to predicted is the benchmarks' to print (benchmarks/rehearse_paper.py), not a
test's to assert: it depends on the machine's load."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rehearse_four_ranks_records_measured_beside_predicted(tmp_path):
    command = [
        sys.executable, "-m", "zbcompile.cli", "rehearse", "--ranks", "4", "--microbatches", "8",
        "--times", "12,12,6,0.5", "--schedules", "1f1b,zb-h1", "--torch", "Schedule1F1B",
        "--steps", "3", "--rounds", "1", "--out", str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert re.search(r"Rehearsal .*: 4 ranks, m=8", done.stdout), done.stdout
    record = json.loads((tmp_path / "rehearsal.json").read_text())
    rows = {r["name"]: r for r in record["rows"]}
    assert set(rows) == {"1f1b", "zb-h1", "torch Schedule1F1B"}
    assert all(row["measured_s"] > 0 for row in rows.values()), rows
    for name in ("1f1b", "zb-h1"):  # ours: the prediction, each rank's busy time, the host time per action
        assert rows[name]["predicted_s"] > 0, rows[name]
        assert len(rows[name]["busy_s"]) == 4 and rows[name]["host_per_action_s"] > 0, rows[name]
        assert 0 <= rows[name]["bubble_predicted"] < 1, rows[name]
    assert rows["zb-h1"]["bubble_predicted"] < rows["1f1b"]["bubble_predicted"]
    svg = (tmp_path / "timelines.svg").read_text()
    assert svg.count("<svg") == 2 and svg.count('class="action F"') == 2 * 4 * 8
