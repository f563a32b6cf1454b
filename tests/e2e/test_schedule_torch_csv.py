"""Our CSV is torch.distributed.pipelining's format both ways: torch's own loader reads ours, and
a file torch writes (its DualPipeV fixture, its lowered form with communication) runs as
`pipeline(schedule=Schedule.from_csv(text))`, with eager's gradients."""

import csv
import io
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _PipelineScheduleRuntime,
    _validate_schedule,
)

import zbcompile
from helpers.models import build
from zbcompile.schedules import Schedule, make_schedule, validate

# torch's DualPipeV on 4 ranks, 10 microbatches, from torch's own tests (tests/data/README.md)
TORCH_DUALPIPEV = Path(__file__).parents[1] / "data" / "dualpipev_4rank_10mb.csv"


def _flat(actions) -> list[str]:
    """torch's actions as text, an OVERLAP_F_B as its sub-actions in order."""
    return [str(s) for a in actions for s in (a.sub_actions or (a,))]


def test_torch_loads_and_validates_our_csv(tmp_path):
    for name, stages in (("zb-h1", 4), ("zb-auto", 4), ("interleaved-1f1b", 8), ("zbv", 8), ("dualpipev", 8)):
        sched = make_schedule(name, stages, 8, time_budget=0)
        path = tmp_path / f"{name}.csv"
        path.write_text(sched.to_csv())
        # PipelineScheduleMulti._load_csv without real stages: the loader only needs these fields.
        loader = PipelineScheduleMulti.__new__(PipelineScheduleMulti)
        loader.pipeline_order = {}
        loader.pp_group_size = sched.ranks
        loader._num_stages = sched.stages
        loader._n_microbatches = sched.microbatches
        loader._stages = []
        loader._load_csv(str(path))
        assert [_flat(loader.pipeline_order[r]) for r in range(sched.ranks)] == sched.rows_as_text()
        mapping = _validate_schedule(loader.pipeline_order, sched.ranks, sched.stages, sched.microbatches)
        assert tuple(mapping[s] for s in range(sched.stages)) == sched.stage_to_rank
        assert repr(_Action.from_str("1SEND_B2")) == "1SEND_B2"


def _torch_order(schedule_class, ranks: int, stages: int, microbatches: int) -> list[list[str]]:
    """torch's per-rank compute order (an overlapped F|B pair as its two sub-actions, F first;
    torch's FULL_BACKWARD "B" is our fused B), from the class's own generator."""
    fake = types.SimpleNamespace(
        pp_group_size=ranks, _n_microbatches=microbatches, _num_stages=stages, _stages=[None] * (stages // ranks)
    )
    rows = []
    for rank in range(ranks):
        actions = schedule_class._calculate_single_rank_operations(fake, rank)
        flat = []
        for a in actions:
            if a is None:
                continue
            flat += [str(s) for s in a.sub_actions] if a.sub_actions else [str(a)]
        rows.append(flat)
    return rows


def test_dualpipev_is_torchs_order():
    for ranks in (2, 3, 4):
        for microbatches in (2 * ranks, 2 * ranks + 3):
            ours = make_schedule("dualpipev", 2 * ranks, microbatches).rows_as_text()
            assert ours == _torch_order(torch_schedules.ScheduleDualPipeV, ranks, 2 * ranks, microbatches)


def test_looped_bfs_is_torchs_order_with_backwards_in_microbatch_order():
    """torch runs a chunk's backwards from the last microbatch down; ours run upwards (the order
    every schedule accumulates gradients in): the same actions, each chunk's B block reversed."""
    ranks, stages, microbatches = 2, 4, 3
    theirs = _torch_order(torch_schedules.ScheduleLoopedBFS, ranks, stages, microbatches)
    ours = make_schedule("looped-bfs", stages, microbatches).rows_as_text()
    for mine, torch_row in zip(ours, theirs):
        forwards = [a for a in torch_row if "F" in a]
        backwards = [a for a in torch_row if "B" in a]
        blocks = [backwards[i : i + microbatches][::-1] for i in range(0, len(backwards), microbatches)]
        assert mine == forwards + [a for block in blocks for a in block]


def test_torch_dualpipev_file_reads_validates_and_writes_back():
    text = TORCH_DUALPIPEV.read_text()
    sched = Schedule.from_csv(text)
    ours = make_schedule("dualpipev", 8, 10)
    assert (sched.stages, sched.microbatches, sched.ranks, sched.stage_to_rank) == (8, 10, 4, ours.stage_to_rank)
    validate(sched)
    assert sched.rows_as_text() == ours.rows_as_text()  # an OVERLAP_F_B cell is its two actions, F first
    assert sched.rows_as_text()[0][17:19] == ["0F7", "7B3"]
    assert len(sched.overlapped) == text.count("OVERLAP_F_B")
    assert sched.to_csv() == text
    assert ours.to_csv() == text  # our DualPipeV, written in torch's format, is torch's file


def _torch_lowered(text: str, ranks: int, stages: int, microbatches: int) -> str:
    """`text` lowered by torch's runtime (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD), as its
    `_dump_csv(format="compute_comms")` writes it."""
    runtime = _PipelineScheduleRuntime.__new__(_PipelineScheduleRuntime)
    runtime.pp_group_size, runtime._num_stages, runtime._n_microbatches = ranks, stages, microbatches
    runtime._stages, runtime._defer_pp_recv = [], False
    runtime.pipeline_order = {
        r: [_Action.from_str(c) for c in row] for r, row in enumerate(csv.reader(io.StringIO(text)))
    }
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in runtime.pipeline_order_with_comms:
        writer.writerow(runtime.pipeline_order_with_comms[rank])
    return out.getvalue()


def test_every_action_torch_writes_is_read():
    """torch's lowered form of its DualPipeV file: messages kept, FSDP's and data parallelism's
    actions counted and left to the runtime, the compute order the file's own."""
    text = TORCH_DUALPIPEV.read_text()
    lowered = _torch_lowered(text, 4, 8, 10)
    assert all(kind in lowered for kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_B", "OVERLAP_F_B"))
    sched = Schedule.from_csv(lowered)
    assert sched.info["ignored_actions"] == {"UNSHARD": 8, "RESHARD": 8, "REDUCE_GRAD": 8}
    assert sched.is_lowered
    validate(sched)
    assert sched.compute_only().rows_as_text() == Schedule.from_csv(text).rows_as_text()


@pytest.mark.parametrize(
    ("cell", "words"),
    [("(0F1;1B0)OVERLAP_X", "only composite"), ("(0F1)OVERLAP_F_B", "two or more compute"), ("0Q1", "cannot parse")],
)
def test_a_cell_torch_does_not_write_is_refused_by_place(cell, words):
    with pytest.raises(ValueError, match=rf"rank 1 \(row 2\), column 2: .*{words}"):
        Schedule.from_csv(f"0F0,0B0\n1F0,{cell}\n")


def _mlp(microbatches: int):
    return build("mlp", batch=microbatches)


def test_torch_dualpipev_file_trains_as_eager_in_one_process():
    """pipeline(schedule=<Schedule>) and set_schedule(<Schedule>): eager's loss and gradients,
    and the bits of our own dualpipev (every schedule accumulates in microbatch order)."""
    sched = Schedule.from_csv(TORCH_DUALPIPEV.read_text(), name="torch-dualpipev")
    reference = _mlp(10)
    expected_loss = reference.eager_loss()
    expected_loss.backward()
    case = _mlp(10)
    pipe = zbcompile.pipeline(case.model, stages=8, microbatches=10, loss_fn=case.loss_fn, schedule=sched)
    loss = case.step(pipe)
    assert pipe.schedule == sched  # run as given (its info records the costs it was checked with)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    given = {n: p.grad.clone() for n, p in case.model.named_parameters()}
    for fqn, param in reference.model.named_parameters():
        torch.testing.assert_close(given[fqn], param.grad, rtol=1e-5, atol=1e-6, msg=fqn)
    pipe.zero_grad()
    pipe.set_schedule("dualpipev")
    case.step(pipe)
    for fqn, param in case.model.named_parameters():
        assert torch.equal(param.grad, given[fqn]), fqn
    pipe.zero_grad()
    pipe.set_schedule(sched)
    case.step(pipe)
    assert pipe.schedule == sched  # run as given (its info records the costs it was checked with)
    for fqn, param in case.model.named_parameters():
        assert torch.equal(param.grad, given[fqn]), fqn


def test_a_schedule_that_does_not_fit_the_pipeline_is_refused():
    sched = Schedule.from_csv(TORCH_DUALPIPEV.read_text())
    case = _mlp(10)
    with pytest.raises(ValueError, match="runs 8 stages .*pipeline has 4; pass stages=8"):
        zbcompile.pipeline(case.model, stages=4, microbatches=10, loss_fn=case.loss_fn, schedule=sched)
    with pytest.raises(ValueError, match="runs 10 microbatches.*in 5; pass microbatches=10"):
        zbcompile.pipeline(case.model, stages=8, microbatches=5, loss_fn=case.loss_fn, schedule=sched)
    with pytest.raises(TypeError, match="schedule must be a name .* or a zbcompile.schedules.Schedule"):
        zbcompile.pipeline(
            case.model, stages=8, microbatches=10, loss_fn=case.loss_fn, schedule=sched.to_csv().splitlines()
        )
    with pytest.raises(ValueError, match=r"ranks \[1\] run no stage"):
        zbcompile.pipeline(
            case.model, stages=1, microbatches=1, loss_fn=case.loss_fn, schedule=Schedule.from_csv("0F0,0B0\n\n")
        )
    incomplete = Schedule.from_csv(TORCH_DUALPIPEV.read_text().replace(",0W9\n", "\n"))
    pipe = zbcompile.pipeline(case.model, stages=8, microbatches=10, loss_fn=case.loss_fn, schedule=incomplete)
    with pytest.raises(ValueError, match="cannot run: rank 0: 0W9 missing"):
        case.step(pipe)
    pipe = zbcompile.pipeline(case.model, stages=4, microbatches=10, loss_fn=case.loss_fn, schedule="1f1b")
    case.step(pipe)
    with pytest.raises(ValueError, match="runs 8 stages .*pipeline has 4"):
        pipe.set_schedule(sched)
    with pytest.raises(ValueError, match="cannot run: rank 0: peak activation memory"):
        pipe.set_schedule(make_schedule("gpipe", 4, 10), memory_limit=2)
