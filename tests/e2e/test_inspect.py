"""Dumps, `zbcompile inspect`, `pipe.explain()`, the trace of a real run and the HTML report."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from unittest import mock

import pytest
from expecttest import TestCase

import zbcompile
from helpers import launches
from helpers.models import build
from zbcompile import cli
from zbcompile.inspect.html import compared_panels, write_compared_png, write_report
from zbcompile.inspect.read import GRAPH_FILES, SCHEDULE_FILE, Dump, load, stage_dir
from zbcompile.inspect.split_diff import split_diff
from zbcompile.inspect.text import summary_text
from zbcompile.inspect.timelines import action_events, load_trace, validate_trace
from zbcompile.inspect.write import DUMP_ENV, CompileDump, program_code
from zbcompile.schedules import Action, make_schedule


def _inspect(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["inspect", *argv])
    return code, out.getvalue(), err.getvalue()


def _mask_compile_times(text: str) -> str:
    return re.sub(r"^compile: .*$", "compile: <seconds per phase>", text, flags=re.M)


def _local_pipeline(directory: str | None, schedule: str = "zb-h1"):
    """The test zoo's MLP on 2 stages, 4 microbatches, one step in this process."""
    case = build("mlp")
    pipe = zbcompile.pipeline(
        case.model, stages=2, microbatches=4, loss_fn=case.loss_fn, schedule=schedule, dump_dir=directory
    )
    case.step(pipe)
    return pipe


# one xdist group: `pytest -n` runs setUpClass's compiles in one worker
@pytest.mark.xdist_group("local-dump")
class LocalDump(TestCase):
    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = cls._tmp.name
        cls.pipe = _local_pipeline(cls.root)

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def test_dump_layout(self):
        directory = os.path.join(self.root, "compile-0")
        expected = {
            "compile.json",
            "stages.txt",
            "forward.py",
            "schedule.txt",
            "schedule.csv",
            "schedule.json",
            "stage0",
            "stage1",
        }
        self.assertEqual(set(os.listdir(directory)), expected)
        for stage in ("stage0", "stage1"):
            self.assertEqual(set(os.listdir(os.path.join(directory, stage))), {"F.py", "I.py", "W.py", "B.py"})
        with open(os.path.join(directory, "schedule.csv")) as f:
            self.assertEqual(f.read(), self.pipe.schedule.compute_only().to_csv())
        with open(os.path.join(directory, "schedule.json")) as f:
            version = json.load(f)["versions"][0]
        self.assertEqual(
            version["lowered"], [[str(a) for a in row] for row in zbcompile.schedules.lower(self.pipe.schedule).actions]
        )
        self.assertEqual(version["cost_source"], "static")

    def test_summary_text(self):
        text = self.pipe.explain()
        self.assertEqual(text, summary_text(load(self.root)), "explain() and inspect differ")
        code, printed, _ = _inspect(self.root)
        self.assertEqual(code, 0)
        self.assertIn(text, printed)
        self.assertExpectedInline(
            _mask_compile_times(text),
            """\
MLP: 2 stages, 4 microbatches, schedule zb-h1 on 2 ranks (one process)
compile: <seconds per phase>

stage  params  param bytes  F flops  I flops  W flops  W share    M_B    M_W  sends
    0     384      1.54 kB   1.41 k        0   2.43 k     100%  176 B  304 B  128 B
    1     340      1.36 kB   1.28 k   1.28 k   1.28 k      50%  576 B  416 B    0 B
boundaries (values sent to the next stage):
  0 -> 1: addmm_1 float32[2, 16] (128 B)
balance: F+I+W per stage relative to the slowest (the schedule's costs): 0.95, 1.00; stage 1 sets the pace

state per rank (replicate, dp=1; AdamW moments in the parameters' dtype), activations per microbatch:
stage    layers  params  param B   grad B  optim B  state B    M_B    M_W
    0  fc1, fc2     384  1.54 kB  1.54 kB  3.07 kB  6.14 kB  176 B  304 B
    1  fc3, fc4     340  1.36 kB  1.36 kB  2.72 kB  5.44 kB  576 B  416 B

schedule zb-h1 (version 0 of 1), 2 ranks (stage->rank 0->0, 1->1), 4 microbatches
costs: static estimates in FLOP-equivalents (FLOPs + 4 x bytes written), comm 0
stage       F       I       W    M_B    M_W
    0  2.94 k       0  9.60 k  176 B  304 B
    1  2.96 k  3.46 k  6.72 k  576 B  416 B
predicted: makespan 55.49 k, span 53.65 k, bubble 7.4% (stage bubble 4.3%); peak activations per rank 480 B, 992 B
measured: none (per-action times are recorded in distributed runs with pipeline(dump_dir=...) or ZBCOMPILE_DUMP)
bubble = 1 - busy / (ranks x makespan); stage bubble = 1 - busy / (ranks x span), the paper's
state per rank outside a step (data_parallel='replicate' over 1 replica; optimizer state as Adam(W)'s two moments):
  rank 0: parameters 1.54 kB, gradients 1.54 kB, optimizer 3.07 kB, total 6.14 kB
  rank 1: parameters 1.36 kB, gradients 1.36 kB, optimizer 2.72 kB, total 5.44 kB""",
        )

    def test_printed_stage_graph(self):
        code, printed, _ = _inspect(self.root, "--stage", "1", "--graph", "W")
        self.assertEqual(code, 0)
        self.assertExpectedInline(
            printed,
            """\
# stage 1, W: weight-gradient backward: parameter gradients
# inputs:
#   saved_gelu <- saved:gelu
#   saved_silu <- saved:silu
#   stash_mse_loss_backward <- stash:mse_loss_backward
#   stash_silu_backward <- stash:silu_backward
# returns, in order:
#   grad:param:fc3.weight
#   grad:param:fc3.bias
#   grad:param:fc4.weight
#   grad:param:fc4.bias
class Stage1WeightBackward(torch.nn.Module):
    def forward(self, saved_gelu: "f32[2, 16]", saved_silu: "f32[2, 16]", stash_mse_loss_backward: "f32[2, 4]", stash_silu_backward: "f32[2, 16]"):
        # module fc4
        t_3: "f32[4, 2]" = torch.ops.aten.t.default(stash_mse_loss_backward)
        mm_1: "f32[4, 16]" = torch.ops.aten.mm.default(t_3, saved_silu)
        t_4: "f32[16, 4]" = torch.ops.aten.t.default(mm_1)
        sum_1: "f32[1, 4]" = torch.ops.aten.sum.dim_IntList(stash_mse_loss_backward, [0], True)
        view: "f32[4]" = torch.ops.aten.view.default(sum_1, [4])
        t_5: "f32[4, 16]" = torch.ops.aten.t.default(t_4)

        # module fc3
        t_7: "f32[16, 2]" = torch.ops.aten.t.default(stash_silu_backward)
        mm_3: "f32[16, 16]" = torch.ops.aten.mm.default(t_7, saved_gelu)
        t_8: "f32[16, 16]" = torch.ops.aten.t.default(mm_3)
        sum_2: "f32[1, 16]" = torch.ops.aten.sum.dim_IntList(stash_silu_backward, [0], True)
        view_1: "f32[16]" = torch.ops.aten.view.default(sum_2, [16])
        t_9: "f32[16, 16]" = torch.ops.aten.t.default(t_8)
        return (t_9, view_1, t_5, view)
""",
        )

    def test_forward_graph_marks_every_node_with_its_stage(self):
        code, printed, _ = _inspect(self.root, "--graph", "forward")
        self.assertEqual(code, 0)
        stage_of = self.pipe.compiled.partition.stage_of_node
        for node in self.pipe.compiled.traced.graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            line = next(line for line in printed.splitlines() if line.strip().startswith(f"{node.name}: "))
            expected = f"# stage {stage_of[node.name]}" if node.name in stage_of else "# every stage that uses it"
            self.assertTrue(line.endswith(expected), line)

    def test_diff_places_every_backward_op(self):
        code, printed, _ = _inspect(self.root, "--diff", "--stage", "1")
        self.assertEqual(code, 0)
        program = self.pipe.compiled.programs[1]

        def names(graph_module):
            return {n.name for n in graph_module.graph.nodes if n.op == "call_function"}

        i, w = names(program.input_backward.graph), names(program.weight_backward.graph)
        for node in names(program.joint.backward.graph):
            mark = next(line[:5] for line in printed.splitlines() if line[7:].startswith(f"{node} = "))
            self.assertEqual(mark, f"  {'I' if node in i else ' '} {'W' if node in w else ' '}", node)
        self.assertIn("I returns: grad:addmm_1, stash:mse_loss_backward, stash:silu_backward", printed)

    def test_errors_name_what_to_do(self):
        code, _, err = _inspect(self.root, "--stage", "7", "--graph", "W")
        self.assertEqual(code, 2)
        self.assertIn("--stage between 0 and 1 (this pipeline has 2 stages), got 7", err)
        with tempfile.TemporaryDirectory() as empty:
            code, _, err = _inspect(empty)
        self.assertEqual(code, 2)
        self.assertIn("is not a zbcompile dump", err)
        self.assertIn("ZBCOMPILE_DUMP=DIR", err)

    def test_report_without_a_trace_draws_the_prediction(self):
        path = os.path.join(self.root, "report.html")
        code, _, _ = _inspect(self.root, "--html", path)
        self.assertEqual(code, 0)
        with open(path) as f:
            html = f.read()
        actions = sorted(str(a) for row in self.pipe.schedule.actions for a in row)
        self.assertEqual(sorted(re.findall(r'<rect class="action \w+" data-action="(\w+)"', html)), actions)
        self.assertIn("measured: no trace recorded", html)


class WithoutDump(TestCase):
    def test_explain_without_a_dump(self):
        with mock.patch.dict(os.environ, {DUMP_ENV: ""}):
            pipe = _local_pipeline(None, schedule="1f1b")
        self.assertIn("schedule 1f1b (version 0 of 1)", pipe.explain())
        self.assertIn("measured: none", pipe.explain())

    def test_environment_variable_turns_dumps_on(self):
        with tempfile.TemporaryDirectory() as root, mock.patch.dict(os.environ, {DUMP_ENV: root}):
            _local_pipeline(None)
            self.assertTrue(os.path.exists(os.path.join(root, "compile-0", "compile.json")))

    def test_explain_before_compiling(self):
        case = build("mlp")
        pipe = zbcompile.pipeline(case.model, stages=2, microbatches=4, loss_fn=case.loss_fn)
        with self.assertRaisesRegex(RuntimeError, "compiles on the first step"):
            pipe.explain()


class FusedOpDiff(TestCase):
    def test_diff_shows_a_fused_op_split_by_its_output_mask(self):
        """With every weight gradient deferred, layer norm's fused backward is cloned: I asks for
        the input gradient, W's copy for the weight and bias gradients."""
        import torch

        from zbcompile.compiler import compile_pipeline
        from zbcompile.models.gpt import GPT, GPTConfig, lm_loss

        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=4, layers=2))
        tokens = torch.randint(0, 64, (2, 8))
        compiled = compile_pipeline(model, lm_loss, (tokens,), {}, tokens.roll(1, 1), 2, min_deferral_intensity=0)
        program = compiled.programs[1]
        with tempfile.TemporaryDirectory() as directory:
            os.makedirs(stage_dir(directory, 1))
            for graph, prog in {
                "I": program.input_backward,
                "W": program.weight_backward,
                "B": program.joint.backward,
            }.items():
                with open(os.path.join(stage_dir(directory, 1), GRAPH_FILES[graph]), "w") as f:
                    f.write(program_code(prog, 1, graph))
            text = split_diff(Dump(directory, {"stages": 2}, [], None), 1)
        lines = text.splitlines()
        fused = next(i for i, line in enumerate(lines) if line.startswith("  I    native_layer_norm_backward = "))
        self.assertTrue(lines[fused].endswith("[True, True, True])"), lines[fused])
        self.assertRegex(
            lines[fused + 1], r"^ +I computes: aten\.native_layer_norm_backward\.default\(.*\[True, False, False\]\)$"
        )
        self.assertRegex(
            text,
            r"\n  \+W   native_layer_norm_backward_default = .*\[False, True, True\]\)  \(not in the unsplit backward\)",
        )


class _FakeRunner:
    """What `CompileDump.record_step` reads from a runner."""

    def __init__(self, schedule, timeline, comm_timeline):
        self.schedule, self.timeline, self.comm_timeline, self.peak_live_bytes = schedule, timeline, comm_timeline, 0


class ScheduleVersions(TestCase):
    def test_a_new_schedule_becomes_a_version_and_steps_name_theirs(self):
        pipe = _local_pipeline(None, schedule="1f1b")
        with tempfile.TemporaryDirectory() as directory:
            recorder = CompileDump(directory, 0, pipe.compiled, pipe.schedule)
            recorder.start_timeline(
                {
                    "rank": 0,
                    "pp_rank": 0,
                    "dp_rank": 0,
                    "stages": [0],
                    "host": "h",
                    "clock": {"perf_counter": 0.0, "time": 0.0},
                }
            )
            other = make_schedule("zb-h1", 2, 4)
            for step, schedule in enumerate([pipe.schedule, other, other]):
                actions = [a for a in zbcompile.schedules.lower(schedule).actions[0]]
                timeline = [(str(a), step + i * 0.01, step + i * 0.01 + 0.005) for i, a in enumerate(actions)]
                recorder.record_step(
                    _FakeRunner(
                        schedule,
                        [e for e in timeline if Action.parse(e[0]).is_compute],
                        [e for e in timeline if not Action.parse(e[0]).is_compute],
                    )
                )
            with open(os.path.join(directory, SCHEDULE_FILE)) as f:
                versions = json.load(f)["versions"]
            self.assertEqual([v["name"] for v in versions], ["1f1b", "zb-h1"])
            trace = load_trace(directory)
            self.assertEqual(
                {e["args"]["step"]: e["args"]["schedule_version"] for e in action_events(trace)}, {0: 0, 1: 1, 2: 1}
            )
            self.assertEqual(validate_trace(trace, [[v["lowered"][0]] for v in versions]), [])


# --- a real two-rank run -----------------------------------------------------------------------

STEPS = launches.INSPECT_STEPS


@pytest.fixture(scope="module")
def distributed_dump():
    """(the dump's directory, each rank's results) of the shared two-rank launch's dumped zb-h1 run."""
    return launches.directory("two-ranks"), launches.two_rank_results("inspect")


@launches.READS_TWO_RANKS
def test_trace_has_one_row_per_rank_and_every_action_once_per_step(distributed_dump):
    root, per_rank = distributed_dump
    code, printed, _ = _inspect(root)
    assert code == 0, printed
    with open(os.path.join(root, "compile-0", "trace.json")) as f:
        trace = json.load(f)
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"]: e["args"]["name"] for e in metadata if e["name"] == "process_name"} == {
        0: "rank 0 (stage 0)",
        1: "rank 1 (stage 1)",
    }
    assert {e["ph"] for e in trace["traceEvents"]} == {"M", "X"}
    for e in actions:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        assert e["tid"] == (0 if Action.parse(e["name"]).is_compute else 1), e
    for rank, result in enumerate(per_rank):
        compute_order = [a for a in result["actions"] if Action.parse(a).is_compute]
        for step in range(STEPS):
            mine = sorted((e for e in actions if e["pid"] == rank and e["args"]["step"] == step), key=lambda e: e["ts"])
            assert Counter(e["name"] for e in mine) == Counter(result["actions"]), (rank, step)
            ran = [e["name"] for e in mine if e["tid"] == 0]
            early = {e["name"] for e in mine if e["args"].get("moved") == "into a wait"}  # W run in a wait
            assert [a for a in ran if a not in early] == [a for a in compute_order if a not in early], (rank, step)
            weights = [a for a in compute_order if Action.parse(a).kind == "W"]
            assert [a for a in ran if a in weights] == weights, (rank, step)  # in the schedule's W order
    with open(os.path.join(root, "compile-0", SCHEDULE_FILE)) as f:
        versions = json.load(f)["versions"]
    assert validate_trace(trace, [v["lowered"] for v in versions]) == []


@launches.READS_TWO_RANKS
def test_explain_equals_inspect_with_measured_times(distributed_dump):
    root, per_rank = distributed_dump
    text = summary_text(load(root))
    assert per_rank[0]["explain"] == text
    assert f"measured: {STEPS - 1} steps of version 0 (steps 1-{STEPS - 1};" in text
    number = lambda pattern: float(re.search(pattern, text).group(1))  # noqa: E731
    makespan, predicted = number(r"makespan (\d+\.\d+) ms, span"), number(r"predicted makespan (\d+\.\d+) ms")
    busy = [float(b) for b in re.search(r"per rank: busy ([\d., ]+) ms", text).group(1).split(", ")]
    ratio = makespan / predicted  # from numbers printed to 0.01 ms: as exact as their rounding allows
    rounding = 0.006 + ratio * (0.005 / makespan + 0.005 / predicted)
    assert number(r"measured / predicted makespan = (\d+\.\d+)") == pytest.approx(ratio, abs=rounding)
    # against the ranks' own clocks around each step(): the actions of a step lie within the
    # earliest start and the latest end of that step's calls, and each rank is busy within its own
    steps = range(1, STEPS)
    windows = [max(r["windows"][s][1] for r in per_rank) - min(r["windows"][s][0] for r in per_rank) for s in steps]
    assert max(busy) <= makespan <= max(windows) * 1e3 + 0.01, (busy, makespan, windows)
    for rank, result in enumerate(per_rank):
        assert busy[rank] <= max(result["windows"][s][1] - result["windows"][s][0] for s in steps) * 1e3 + 0.01, rank


def _svgs(html: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", html, flags=re.S)


@launches.READS_TWO_RANKS
def test_report_draws_one_box_per_action(distributed_dump):
    root, per_rank = distributed_dump
    path = write_report(root, os.path.join(root, "report.html"))
    with open(path) as f:
        html = f.read()
    assert "<script" not in html and "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    predicted, measured = _svgs(html)[:2]
    boxes = lambda svg: sorted(re.findall(r'<rect class="action \w+" data-action="(\w+)"', svg))
    computed = sorted(a for result in per_rank for a in result["actions"] if Action.parse(a).is_compute)
    assert boxes(predicted) == computed
    assert boxes(measured) == sorted(a for result in per_rank for a in result["actions"])
    assert re.search(r"measured / predicted makespan: \d+\.\d\d", html)
    assert html.count('<rect class="bar"') >= 2 * 3 * 2  # F/I/W time per stage, predicted and measured


def _chromium() -> str | None:
    return next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome", "headless_shell")
            if shutil.which(n)
        ),
        None,
    )


@launches.READS_TWO_RANKS
def test_report_screenshot_shows_the_timelines(distributed_dump):
    """The report opened in a real browser. `make test` installs Chromium (`make browser`); in CI a
    missing browser fails the test instead of skipping it."""
    import matplotlib.image
    import numpy as np

    if _chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium in CI: `make browser` (as root) installs Debian's chromium")
        pytest.skip("no Chromium on this machine: `make browser` as root installs it")
    root, _ = distributed_dump
    page = write_report(root, os.path.join(root, "report.html"))
    shot = os.path.join(root, "report.png")
    subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,700",
         f"--screenshot={shot}", f"file://{os.path.abspath(page)}"],
        check=True, capture_output=True, timeout=120,
    )
    pixels = (matplotlib.image.imread(shot)[:, :, :3] * 255).round().astype(int)

    def count(colour: str) -> int:
        rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(pixels - rgb).sum(axis=2) <= 6).sum())

    for colour in ("#8fb4e3", "#7fd1c7", "#a8d98a"):  # F, B (I) and W boxes of both timelines
        assert count(colour) > 200, colour


@launches.READS_TWO_RANKS
def test_report_compares_measured_steps_with_the_bubble_shaded(distributed_dump, tmp_path):
    root, per_rank = distributed_dump
    html = open(write_report(root, str(tmp_path / "compared.html"), compared=[root])).read()
    computed = sorted(a for result in per_rank for a in result["actions"] if Action.parse(a).is_compute)
    rect = re.compile(r'<rect class="action (\w+)" data-action="(\w*)" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)"')
    asked_other = load(root)
    asked_other.record["options"]["schedule"] = "zb-auto"  # as where zb-auto's race chose zb-h1's order
    (title, _), = compared_panels([asked_other])
    assert re.match(r"zb-auto, step \d+ \(the median of \d+ steady steps\): ran zb-h1 \(chosen by timing\)", title)
    for svg in _svgs(html)[:2]:  # the compared run above, this run below
        assert re.search(r"zb-h1, step \d+ \(the median of \d+ steady steps\).*idle \d+% of the ranks' spans", svg)
        rects = [(kind, action, float(x), float(y), float(w)) for kind, action, x, y, w in rect.findall(svg)]
        assert sorted(a for kind, a, *_ in rects if kind != "idle") == computed
        busy = [(y, x, x + w) for kind, _, x, y, w in rects if kind != "idle"]
        for kind, _, x, y, w in rects:
            if kind == "idle":  # inside a rank's span, overlapping none of its actions
                assert not any(
                    by == y and bx < x + w - 0.6 and x + 0.6 < bend for by, bx, bend in busy
                )  # boxes are >= 0.5 px wide
                assert (
                    min(bx for by, bx, _ in busy if by == y) <= x
                    and x + w <= max(bend for by, _, bend in busy if by == y) + 0.01
                )
    png = write_compared_png([load(root)] * 2, str(tmp_path / "timelines.png"))
    assert os.path.getsize(png) > 1000
