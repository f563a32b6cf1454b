"""One step: the runners (over processes, or every stage in one), the interpreter that runs a
rank's program action by action, the stage executor, readiness, per-action clocks, the
transport and its messages, tied weights' gradients, evaluation's forward-only step.

May import `runtime.parallel` and the layers below the runtime; never `runtime.state`,
`runtime.tuning` or `runtime.build`."""
