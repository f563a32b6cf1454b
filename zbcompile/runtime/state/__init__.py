"""What each rank holds and how it changes hands: parameters' placement by stage, this process's
state (`StateOwnership`), state moved between ranks at a new cut, the post-validated optimizer
and its rollback.

May import `runtime.step` and `runtime.parallel` and the layers below the runtime; never
`runtime.tuning` or `runtime.build`."""
