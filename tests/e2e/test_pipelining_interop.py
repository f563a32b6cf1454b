"""torch.distributed.pipelining's zero-bubble schedules over stages compiled in place with the
"zbcompile" backend (2 ranks, gloo): the same gradients as the eager step, with every stage's W
taken through `dw_builder`."""

from __future__ import annotations

import torch

from helpers import launches
from helpers import pipelining_workers as workers

pytestmark = launches.READS_TWO_RANK_MODELS

SCHEDULES = launches.PIPELINING_SCHEDULES


def test_zero_bubble_schedules_over_compiled_stages_match_eager():
    per_rank = launches.two_rank_results("pipelining")  # the shared two-rank launch
    reference = workers.pipelining_interop.eager_grads()
    microbatches = workers.pipelining_interop.MICROBATCHES
    for schedule in SCHEDULES:
        grads = {}
        for rank, results in enumerate(per_rank):
            result = results[schedule]
            # each of the rank's two stages deferred one W per microbatch and handed it over
            assert [n > 0 for n in result["handed_over"]] == [True] * (2 * microbatches), (
                schedule,
                rank,
                result["handed_over"],
            )
            assert result["left_in_store"] == 0, (schedule, rank)
            grads.update(result["grads"])
        assert grads.keys() == reference.keys(), schedule
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule} {name}: {m}")
