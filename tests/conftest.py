"""Every test process computes on one thread. The suite runs two xdist workers on two cores (and
the multi-process tests one thread per rank, `helpers/multiprocess.py`); intra-op threads beyond
the cores only wait for each other (OpenMP spins while it waits), several times the CPU time of
one thread for the same results."""

import os

import torch

from helpers import launches

torch.set_num_threads(1)


def pytest_configure(config):
    """Tell the shared launches (`helpers/launches.py`) when tests run grouped by xdist_group: each
    launch then refuses a reader outside its group, which another worker would launch anew for."""
    if getattr(config.option, "dist", "no") == "loadgroup":
        os.environ[launches.GROUPED] = "1"
