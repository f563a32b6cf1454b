"""The commands and scripts a user starts first, run end to end as a user runs them: `zbcompile
demo` (one short round; its report and picture) and `examples/train_gpt.py` under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _two_cores() -> None:
    """In the child: the first two cores this process may use (the demo lays out one rank per core)."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def _run(command: list[str], cwd: str, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=_two_cores)
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.xdist_group("distributed")
def test_demo_one_round_writes_the_report_and_the_picture(tmp_path):
    out = tmp_path / "demo"
    stdout = _run([sys.executable, "-m", "zbcompile.cli", "demo", "--rounds", "1", "--out", str(out)], str(tmp_path), 600)
    assert re.search(r"zb-auto vs 1f1b: \d+\.\d{3}x the speed \((faster|SLOWER); median over 1 rounds", stdout), stdout
    assert re.search(r"1f1b\s+[\d.]+ ms\s+\d+\.\d{4}", stdout) and re.search(r"zb-auto\s+[\d.]+ ms\s+\d+\.\d{4}", stdout), stdout
    assert "simulator's predicted gain" in stdout, stdout
    html = (out / "report.html").read_text()
    svgs = re.findall(r"<svg.*?</svg>", html, flags=re.S)
    labels = [re.search(r"(1f1b|zb-auto), step \d+ \(the median of \d+ steady steps\)", svg) for svg in svgs[:2]]
    assert [m.group(1) for m in labels if m] == ["1f1b", "zb-auto"], "both schedules' measured steps, compared above"
    assert all('<rect class="action' in svg for svg in svgs[:2])
    with open(out / "timelines.png", "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert {"1f1b", "zb-auto"} <= set(os.listdir(out / "dump"))


@pytest.mark.xdist_group("distributed")
def test_train_gpt_example_runs_a_few_steps_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    stdout = _run([torchrun, "--nproc-per-node", "2", script, "--stages", "2", "--microbatches", "2", "--steps", "4"], str(tmp_path), 300)
    losses = [float(x) for x in re.findall(r"rank \d step +\d+ loss (\d+\.\d+)", stdout)]  # the last stage's rank
    assert len(losses) == 4, stdout
    assert all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0], losses
