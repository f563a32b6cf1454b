"""The commands and scripts a user starts first, run end to end as a user runs them: `zbcompile
demo` (one short round; its report and picture), `examples/train_gpt.py` and
`examples/finetune_llama.py` (stopped, then resumed) under torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# torchrun's default rendezvous port (29500) takes one run at a time: the torchrun tests share a worker
TORCHRUN = pytest.mark.xdist_group("torchrun-default-port")


def _two_cores() -> None:
    """In the child: the first two cores this process may use (the demo lays out one rank per core)."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def _run(command: list[str], cwd: str, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=_two_cores
    )
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "terminate called" not in done.stderr, f"{command}:\n{done.stderr}"
    return done.stdout


EXIT_CHECK = os.path.join(ROOT, "tests", "helpers", "exit_check.py")


def _torchrun(script: str, arguments: list[str], cwd: str, timeout: float = 300) -> str:
    """`script` on 2 ranks under torchrun, as a user runs it, through `helpers/exit_check.py`:
    besides exit code 0, every rank must have left no gloo or transport thread alive as Python
    finalizes (a thread in C++ code then aborts the process, whatever the timing)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    stdout = _run([torchrun, "--nproc-per-node", "2", EXIT_CHECK, script, *arguments], cwd, timeout)
    for rank in range(2):
        assert f"exit check, rank {rank}: no threads left" in stdout, stdout[-3000:]
    return stdout


def test_demo_one_round_writes_the_report_and_the_picture(tmp_path):
    out = tmp_path / "demo"
    stdout = _run(
        [sys.executable, "-m", "zbcompile.cli", "demo", "--rounds", "1", "--out", str(out)], str(tmp_path), 600
    )
    assert re.search(r"zb-auto vs 1f1b: \d+\.\d{3}x the speed \((faster|SLOWER); median over 1 rounds", stdout), stdout
    assert re.search(r"1f1b\s+[\d.]+ ms\s+\d+\.\d{4}", stdout) and re.search(
        r"zb-auto\s+[\d.]+ ms\s+\d+\.\d{4}", stdout
    ), stdout
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


@TORCHRUN
def test_train_gpt_example_runs_a_few_steps_under_torchrun(tmp_path):
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    stdout = _torchrun(script, ["--stages", "2", "--microbatches", "2", "--steps", "4"], str(tmp_path))
    losses = [float(x) for x in re.findall(r"rank \d step +\d+ loss (\d+\.\d+)", stdout)]  # the last stage's rank
    assert len(losses) == 4, stdout
    assert all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0], losses


@TORCHRUN
def test_finetune_llama_example_resumes_and_matches_eager(tmp_path):
    """4 steps with evaluation and a checkpoint every 2, then `--resume` to 6: the resumed run
    starts at step 4 with the history the checkpoint kept, and the picture's numbers (training
    loss every step, held-out loss every 2 steps) equal the eager run's on the same batches.
    Both launches exit cleanly (`_torchrun`); `benchmarks/clean_exits.py` repeats them."""
    script = os.path.join(ROOT, "examples", "finetune_llama.py")
    out = tmp_path / "losses.png"
    common = [
        "--eval-every",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
    ]
    first = _torchrun(script, ["--steps", "4", *common], str(tmp_path))
    second = _torchrun(script, ["--steps", "6", "--resume", *common], str(tmp_path))
    assert re.search(r"rank 0: resumed from \S+step_000004 at step 4", second), second
    before = {int(s): float(v) for s, v in re.findall(r"rank \d step +(\d+) loss (\d+\.\d+)", first)}
    after = {int(s): float(v) for s, v in re.findall(r"rank \d step +(\d+) loss (\d+\.\d+)", second)}
    assert sorted(before) == [0, 1, 2, 3] and sorted(after) == [4, 5], (first, second)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out.with_suffix(".json")) as f:
        numbers = json.load(f)
    pipelined, eager = numbers["pipelined"], numbers["eager"]
    assert sorted(map(int, pipelined["train"])) == list(range(6)) and sorted(map(int, pipelined["eval"])) == [1, 3, 5]
    for step, loss in {**before, **after}.items():  # printed with 6 decimals
        assert abs(pipelined["train"][str(step)] - loss) < 1e-6, (step, loss, pipelined["train"])
    for kind in ("train", "eval"):
        assert pipelined[kind].keys() == eager[kind].keys(), kind
        got, expected = (torch.tensor([run[kind][s] for s in sorted(run[kind], key=int)]) for run in (pipelined, eager))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, msg=lambda m, kind=kind: f"{kind}: {m}")
