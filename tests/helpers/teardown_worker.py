"""One rank of the teardown test (`python tests/helpers/teardown_worker.py RANK PORT COUNT`):
builds, steps and drops COUNT short two-rank pipelines one after another, then leaves the
interpreter the usual way, the second rank with a receive still awaited, watched by a helper
thread, whose message the first rank sends only after it has left. Its exit code is the test's
verdict: a helper thread inside gloo's wait when Python finalizes aborts the process (134)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import zbcompile

LATE_TAG = 999_999


def main(rank: int, port: int, count: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
    for _ in range(count):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        pipe = zbcompile.pipeline(
            model, stages=2, microbatches=2, loss_fn=nn.functional.mse_loss, schedule="zb-h1", timeout=60
        )
        pipe.step(x, target=y)
    transport = pipe.runner.transport
    if rank == 1:  # leaves while its helper thread still waits for this message
        transport.post_recv([torch.empty(4)], 0, LATE_TAG, "a receive left awaited", watch=True)
        dist.barrier()
    else:
        dist.barrier()
        time.sleep(0.5)  # the other rank is finalizing by now
        transport.send([torch.ones(4)], 1, LATE_TAG, "a late send")
        transport.complete_messages()
    print(f"rank {rank}: {count} pipelines done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
