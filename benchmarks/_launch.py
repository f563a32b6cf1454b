"""Shared helpers of the benchmark scripts: launch local gloo ranks (one thread each), take
medians, describe the machine's load, write a results file."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time
from typing import Any, Callable, Sequence

from zbcompile import local_ranks
from zbcompile.local_ranks import free_port  # noqa: F401 (the benchmarks use it from here)
from zbcompile.measure import cpu_busy_seconds, median  # noqa: F401 (the benchmarks use them from here)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def gpt(settings: Any, **config: Any) -> Any:
    """A `zbcompile.models.GPT` of `settings`' vocab, seq_len, hidden, heads and layers (other
    GPTConfig fields from `config`), its weights from seed 0."""
    import torch

    from zbcompile.models import GPT, GPTConfig

    torch.manual_seed(0)
    shape = {k: getattr(settings, k) for k in ("seq_len", "hidden", "heads", "layers")}
    return GPT(GPTConfig(vocab_size=settings.vocab, **shape, **config))


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """`fn(*args)` on `world` local gloo ranks (`zbcompile.local_ranks.run_ranks`), every wait on
    a peer bounded by `timeout_s`; rank r's result at index r; raises if any rank fails."""
    return local_ranks.run_ranks(world, fn, *args, timeout_s=max(timeout_s, 3600.0), group_timeout_s=timeout_s)


def placement(schedule: Any) -> str:
    """"v" where `schedule` runs two chunks per rank, else "in-line" (whichever schedule a race kept)."""
    return "v" if schedule.stages == 2 * schedule.ranks else "in-line"


def machine() -> dict[str, Any]:
    """CPU count, load averages and versions, for the results' header."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def load_line(info: dict[str, Any]) -> str:
    one, five, fifteen = info["loadavg_1_5_15"]
    return f"{info['cpus']} CPUs, load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def write_results(name: str, data: dict[str, Any], markdown: str) -> tuple[pathlib.Path, pathlib.Path]:
    RESULTS.mkdir(exist_ok=True)
    json_path = RESULTS / f"{name}.json"
    md_path = RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "__dict__"):
        return vars(value)
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (also readable printed)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def run_and_report(
    name: str, world: int, rank_main: Callable, settings: Any, analyse: Callable, report: Callable, write: bool
) -> None:
    """Run `rank_main(settings)` on `world` ranks, then `analyse(per_rank, settings, machine
    before, machine after, wall seconds)`, print `report(data)` and, if `write`, store both under
    benchmarks/results/<name>.{json,md}."""
    before = machine()
    print(f"machine: {load_line(before)}", flush=True)
    started = time.perf_counter()
    per_rank = run_ranks(world, rank_main, settings, timeout_s=settings.timeout_s)
    data = analyse(per_rank, settings, before, machine(), time.perf_counter() - started)
    text = report(data)
    print(text)
    if write:
        paths = write_results(name, data, text)
        print("wrote " + ", ".join(str(p) for p in paths))
