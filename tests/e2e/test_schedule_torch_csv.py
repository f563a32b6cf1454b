"""Our CSV is torch.distributed.pipelining's compute-only format: torch's own loader reads it."""

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
