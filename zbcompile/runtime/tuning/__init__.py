"""Measurement and the decisions taken from it: the first compile's calibration steps (the cut
decided again, the schedules raced), the cost tuner's re-solves and the trials that keep a change
only where real steps measure it faster, per-block times and each rank's speed.

Owns no tensors of the model. May import `runtime.state`, `runtime.step`, `runtime.parallel`
and the layers below the runtime; never `runtime.build`."""
