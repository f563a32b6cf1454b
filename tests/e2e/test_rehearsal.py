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


def _plan_record(ranks: int, microbatches: int) -> dict:
    """A `zbcompile plan --json` record as the plan writes it with dp=2: 1F1B over `ranks` stages
    and a menu choice of ZBV over twice as many chunks, each stage (chunk) with its gradient
    reduction's seconds."""
    from zbcompile.schedules import Costs, make_schedule, simulate

    seconds = {"F": 0.004, "I": 0.004, "W": 0.002}
    reduce = [0.012 + 0.002 * s for s in range(ranks)]
    costs = Costs(f=seconds["F"], i=seconds["I"], w=seconds["W"], comm=0.0005, reduce=reduce)
    one = make_schedule("1f1b", ranks, microbatches, costs)
    chunks = Costs(f=seconds["F"] / 2, i=seconds["I"] / 2, w=seconds["W"] / 2, comm=0.0005,
                   reduce=[r / 2 for r in reduce for _ in range(2)])
    v = make_schedule("zbv", 2 * ranks, microbatches, chunks, ranks=ranks)
    resolved = chunks.resolve(2 * ranks)
    return {
        "model": "Toy", "microbatches": microbatches, "dp": 2, "data_parallel": "replicate", "comm_seconds": 0.0005,
        "stage_rows": [{"seconds": dict(seconds)} for _ in range(ranks)],
        "schedules": [{"name": "1f1b", "span": simulate(one, costs).span, "reduce_seconds": reduce,
                       "actions": one.compute_only().rows_as_text()}],
        "menu_choice": {
            "schedule": "zbv", "recompute": "none", "step": simulate(v, chunks).span,
            "actions": v.compute_only().rows_as_text(),
            "seconds": {"f": list(resolved.f), "i": list(resolved.i), "w": list(resolved.w), "comm": 0.0005,
                        "reduce": list(resolved.reduce)},
        },
    }


def test_a_plan_with_replicas_is_rehearsed_with_each_stages_reduction_after_its_last_w():
    """dp=2 in the plan: every rank posts one emulated reduction per stage (chunk) it holds, after
    that stage's last W, in the order of their last W, one at a time on its link, each lasting
    the plan's seconds; the rehearsal's simulator predicts the plan's step, reductions' tail
    included, and the report says what both contain."""
    from zbcompile.rehearsal.rehearse import plan_times, rehearse
    from zbcompile.rehearsal.report import report_text
    from zbcompile.schedules import Action

    record = _plan_record(3, 6)
    settings = plan_times(record, steps=2, settle=1, rounds=1, warmup=1)
    done = rehearse(settings)
    rows = {r["name"]: r for r in done["rows"]}
    assert set(rows) == {"1f1b", "menu: zbv"}
    for prepared in settings.given:
        row = rows[prepared.name]
        assert abs(row["predicted_s"] - row["plan_s"]) < 1e-12 and row["reduce_tail_s"] > 0, row
        for rank, timeline in enumerate(done["timelines"][prepared.name]):
            last_w = {}
            for text, _, end in timeline["compute"]:
                action = Action.parse(text)
                if action.kind in ("W", "B"):
                    last_w[action.stage] = max(last_w.get(action.stage, 0.0), end)
            reductions = sorted((s, int(t.split()[1]), e) for t, s, e in timeline["comm"] if t.startswith("REDUCE"))
            assert sorted(stage for _, stage, _ in reductions) == sorted(prepared.schedule.stages_on(rank))
            assert [stage for _, stage, _ in reductions] == sorted(last_w, key=last_w.__getitem__)
            link = 0.0
            for start, stage, end in reductions:
                assert start >= max(last_w[stage], link)  # after its last W and the reduction before it
                assert abs(end - start - prepared.costs.reduce[stage] * settings.unit_s) < 1e-9
                link = end
    text = report_text(done)
    assert "each stage's gradient reduction over the replicas at the plan's time" in text
    assert "In neither: the optimizer step" in text
