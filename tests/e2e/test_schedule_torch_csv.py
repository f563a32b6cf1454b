"""Our CSV is torch.distributed.pipelining's compute-only format: torch's own loader reads it."""

import types

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _validate_schedule

from zbcompile.schedules import make_schedule


def test_torch_loads_and_validates_our_csv(tmp_path):
    for name, stages in (("zb-h1", 4), ("zb-auto", 4), ("interleaved-1f1b", 8), ("zbv", 8)):
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
        assert [[str(a) for a in loader.pipeline_order[r]] for r in range(sched.ranks)] == sched.rows_as_text()
        mapping = _validate_schedule(loader.pipeline_order, sched.ranks, sched.stages, sched.microbatches)
        assert tuple(mapping[s] for s in range(sched.stages)) == sched.stage_to_rank
        assert repr(_Action.from_str("1SEND_B2")) == "1SEND_B2"


def _torch_order(schedule_class, ranks: int, stages: int, microbatches: int) -> list[list[str]]:
    """torch's per-rank compute order (an overlapped F|B pair as its two sub-actions, F first;
    torch's FULL_BACKWARD "B" is our fused B), from the class's own generator."""
    fake = types.SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, _num_stages=stages, _stages=[None] * (stages // ranks))
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
