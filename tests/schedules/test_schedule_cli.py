"""`zbcompile schedule`: the table, the grid and the pictures."""

import argparse
import re

from zbcompile.schedules import cli, make_schedule
from zbcompile.schedules.render import Box, layout, to_svg


def _run(argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_svg_has_one_box_per_action():
    sched = make_schedule("zb-h1", 3, 4)
    svg = to_svg(layout(sched), title="zb-h1")
    rects = re.findall(r'<rect class="action (\w)" data-action="(\w+)"', svg)
    assert sorted(a for _, a in rects) == sorted(str(a) for row in sched.actions for a in row)
    assert {k for k, _ in rects} == {"F", "I", "W"}
    assert svg.count("<text") == len(rects) + 1 + sched.ranks  # labels, title, rank names


def test_renderer_accepts_plain_boxes():
    svg = to_svg([Box(0, 0.0, 1.0, "0", "F", "0F0"), Box(1, 0.5, 2.0, "0", "B", "1B0")])
    assert svg.count("<rect") == 2


def test_cli_prints_table_grid_and_writes_pictures(tmp_path, capsys):
    out = tmp_path / "timeline.svg"
    code = _run(
        ["schedule", "--stages", "4", "--microbatches", "8", "--f", "1.2,1,1,1.5", "--i", "1", "--w", "0.5",
         "--comm", "0.1", "--memory-limit", "1p", "--schedule", "1f1b,zb-auto", "--time-budget", "0",
         "--out", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert re.search(r"^1f1b\s+4\s+1\s+\d+\.\d{3}\s+\d+\.\d{3}\s+0\.\d{4}", text, re.M)
    assert re.search(r"^zb-auto\s", text, re.M)
    assert "Step 00: 0F0" in text
    for name in ("1f1b", "zb-auto"):
        svg = (tmp_path / f"timeline-{name}.svg").read_text()
        assert len(re.findall(r'<rect class="action [FIWB]"', svg)) == 4 * 8 * (2 if name == "1f1b" else 3)
        assert (tmp_path / f"timeline-{name}.png").stat().st_size > 1000
    svg = (tmp_path / "timeline-zb-auto.svg").read_text()
    assert re.findall(r'<rect class="legend (\w+)"', svg)[:3] == ["F", "I", "W"]
    assert "I: input-gradient backward" in svg


def test_cli_compares_chunk_counts_on_one_model(capsys):
    """--ranks 4: 1F1B on 4 stages, V-Half on 8 chunks of half the costs, zb-auto under 0.6 of
    1F1B's memory on a V: the same ranks, busy time and memory unit for all."""
    code = _run(
        ["schedule", "--ranks", "4", "--microbatches", "8", "--mem-w", "0.5", "--memory-limit", "0.6p",
         "--schedule", "1f1b,v-half,zb-auto", "--time-budget", "0", "--no-grid"]
    )
    assert code == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:5]}
    assert rows["1f1b"][1:3] == ["4", "1"] and rows["v-half"][1:3] == ["4", "2"] and rows["zb-auto"][1:3] == ["4", "2"]
    assert float(rows["v-half"][7]) <= 0.75 * float(rows["1f1b"][7])  # peak memory, one unit for all
    assert float(rows["zb-auto"][7]) <= 0.6 * float(rows["1f1b"][7]) + 1e-9

def test_memory_limit_spec():
    from zbcompile.schedules.costs import Costs

    assert cli.memory_limit_for("2p", "zb-auto", 4, Costs(mem_b=[1, 2, 1, 1])) == [8, 16, 8, 8]
    assert cli.memory_limit_for("1p", "zbv", 4, Costs()) == [4, 4]
    assert cli.memory_limit_for("7.5", "zb-auto", 4, Costs()) == 7.5


def test_cli_counts_each_stages_reduction(capsys):
    """--reduce 3,0: 1F1B's span grows by stage 0's reduction, the tail after its last B."""
    rows = []
    for reduce in ("0", "3,0"):
        _run(
            ["schedule", "--stages", "2", "--microbatches", "4", "--reduce", reduce, "--schedule", "1f1b", "--no-grid"]
        )
        rows.append(capsys.readouterr().out.splitlines()[2].split())
    assert float(rows[1][4]) == float(rows[0][4]) + 3.0  # span
