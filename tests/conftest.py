"""Every test process computes on one thread. The suite runs two xdist workers on two cores (and
the multi-process tests one thread per rank, `helpers/multiprocess.py`); intra-op threads beyond
the cores only wait for each other (OpenMP spins while it waits), several times the CPU time of
one thread for the same results."""

import torch

torch.set_num_threads(1)
