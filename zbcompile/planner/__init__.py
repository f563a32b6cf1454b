"""The planner: a training run sized before the GPUs (`zbcompile.plan`, `zbcompile plan`).

    plan.py      plan(): a given layout (stages, microbatches, dp, tp) priced: memory per rank, the
                 schedules, the menu under the memory limit, the cut where memory binds
    layouts.py   plan(gpus=N): the layouts of N GPUs searched (`search.py`), with their records
    search.py    the layout search and a layout's menu: options priced in the order of their bound
    units.py     a model's costs per position, compiled once for every layout
    memory.py    memory's bound on a step, and the cut with each stage's recomputation
    cut.py       the plan's cut where the memory limit binds or the ranks differ
    hardware.py  a hardware profile: FLOPs and bytes turned into seconds
    report.py    the plan's and the search's text
    cli.py       `zbcompile plan`
"""
