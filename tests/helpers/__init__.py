"""What the test modules share (`tests` is on pytest's `pythonpath`, so `from helpers.models
import build`):

    models       a zoo of tiny models and their eager references
    real_models  models as their libraries (transformers) build them
    grads        comparing gradients with the eager reference
    multiprocess run a function on N local processes in a gloo group
    *_workers    what each rank runs in the multi-process tests (importable by spawned processes)
"""
