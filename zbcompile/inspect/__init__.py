"""What the compiler did, for people and for tools (`docs/inspect.md`):

    write   the dump of a compile (`ZBCOMPILE_DUMP` / `pipeline(dump_dir=...)`) and its records
    read    the dump's layout, and a dump read back (`load`)
    text    per-stage tables, the schedule's predicted against measured summary, the I/W split
    html    the self-contained report page and the compared timelines picture
    trace   per-rank timelines and their merge into one Chrome/Perfetto trace
    cli     `zbcompile inspect DIR`

Pure Python: nothing here imports torch or `zbcompile.api`.
"""
