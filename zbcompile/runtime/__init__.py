"""Executes a Schedule over the compiled stages, in four rooms, each importing only the rooms
below it (`tests/test_structure.py` checks the order, docs/architecture.md lists it):

    build.py    Builder: a batch's compile and everything a step needs, assembled (may import all)
    tuning/     measurement and decisions: calibration, races and trials, the cost tuner, the re-cut
    state/      what each rank holds: placement, ownership, hand-over at a new cut, the optimizer
    step/       one training step: runners, the interpreter, stages, readiness, the transport
    parallel/   the dimensions around a pipeline: layout and process groups, the batch and its
                loss, gradient reduction over replicas, sharding, tensor parallelism"""
