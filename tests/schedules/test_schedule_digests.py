"""The schedule makers the planner and the runtime share give the same actions in the same order as
when `tests/data/schedule_digests.json` was written, on a corpus of random costs, stage counts,
microbatch counts and memory limits (zb-auto in-line and over a V, with and without its search;
ZBV, V-Half, V-Min, 1F1B, ZB-H1, ZB-H2): a change meant to make them faster must not change them.
A change meant to change a schedule rewrites the file:

    python tests/schedules/test_schedule_digests.py
"""

import hashlib
import json
import pathlib
import random

from zbcompile.schedules import Costs
from zbcompile.schedules.cut_choice import cut_schedule
from zbcompile.schedules.cut_search import Cut

DIGESTS = pathlib.Path(__file__).parent.parent / "data" / "schedule_digests.json"
CASES = 40


def corpus(cases: int = CASES):
    """(case, ranks, microbatches, V or not, per-stage costs, each rank's room or None)."""
    rng = random.Random(1234)
    for case in range(cases):
        p = rng.choice([2, 3, 4, 6, 8])
        m = max(p, rng.choice([p, p + 1, 2 * p, 3 * p, 4 * p, 8]))
        v = rng.random() < 0.5
        stages = 2 * p if v else p
        f = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        i = [x * rng.uniform(0.8, 2.0) for x in f]
        w = [x * rng.uniform(0.3, 1.2) for x in f]
        mem_b = [rng.uniform(0.5, 1.0) for _ in range(stages)]
        mem_w = [x * rng.uniform(0.2, 1.3) for x in mem_b]
        reduce = [rng.uniform(0, 3.0) for _ in range(stages)] if rng.random() < 0.5 else [0.0] * stages
        costs = Costs(f=f, i=i, w=w, comm=rng.uniform(0, 0.3), mem_b=mem_b, mem_w=mem_w, reduce=reduce)
        room = [rng.uniform(1.0, 1.3 * p) * (2 if v else 1) for _ in range(p)] if rng.random() < 0.8 else None
        yield case, p, m, v, costs, room


def digests(cases: int = CASES) -> dict[str, str]:
    """Per case and schedule: the digest of its actions, rank by rank, or of the error it raises."""
    found = {}
    for case, p, m, v, costs, room in corpus(cases):
        names = ("zb-auto", "zbv", "v-half", "v-min") if v else ("zb-auto", "1f1b", "zb-h1", "zb-h2")
        cut = Cut("v" if v else "in-line", tuple(range(1, 2 * p if v else p)))
        for name in names:
            for budget in (0.0, 1.0) if name == "zb-auto" else (0.0,):
                try:
                    made = cut_schedule(name, cut, costs, m, room if name in ("zb-auto", "zbv") else None,
                                        time_budget=budget)
                    text = repr(made.rows_as_text()) + repr(made.stage_to_rank)
                except ValueError as error:
                    text = f"error: {error}"
                found[f"{case}:{name}:{budget}"] = hashlib.sha1(text.encode()).hexdigest()
    return found


def test_the_schedules_are_those_the_digests_recorded():
    want = json.loads(DIGESTS.read_text())
    got = digests()
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []


if __name__ == "__main__":
    DIGESTS.write_text(json.dumps(digests(), indent=0, sort_keys=True) + "\n")
