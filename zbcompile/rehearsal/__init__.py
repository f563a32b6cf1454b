"""The rehearsal: a pipeline run at a scale this machine cannot compute, run by the real runtime
on local processes whose actions take emulated times (`zbcompile rehearse`).

    rehearse.py         the settings (the paper's times, a plan's, given ones) and the run
    torch_schedules.py  torch.distributed.pipelining's schedules under the same times
    report.py           what was measured beside what was predicted, and the timelines
    cli.py              `zbcompile rehearse`
"""
