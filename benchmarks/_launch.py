"""Shared helpers of the benchmark scripts: the fields their settings share, the model and batch a
rank trains, launch local gloo ranks (one thread each), take medians, describe the machine's load,
read the common command-line options, format tables and write a results file."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from zbcompile.measure import median  # noqa: F401 (the benchmarks use it from here)
from zbcompile.runtime.parallel import local_ranks
from zbcompile.runtime.parallel.local_ranks import free_port  # noqa: F401 (the benchmarks use it from here)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Settings:
    """What every script launching ranks sets (its own Settings extends it): the model's shape,
    sequences per microbatch, microbatches, rounds of `steps_per_round` timed steps, and how long
    any wait on a peer may take."""

    vocab: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    rows: int = 2  # sequences per microbatch
    microbatches: int = 8
    rounds: int = 6
    steps_per_round: int = 3
    timeout_s: float = 600.0


def gpt(settings: Any, **config: Any) -> Any:
    """A `zbcompile.models.GPT` of `settings`' vocab, seq_len, hidden, heads and layers (other
    GPTConfig fields from `config`), its weights from seed 0."""
    import torch

    from zbcompile.models import GPT, GPTConfig

    torch.manual_seed(0)
    shape = {k: getattr(settings, k) for k in ("seq_len", "hidden", "heads", "layers")}
    return GPT(GPTConfig(vocab_size=settings.vocab, **shape, **config))


def batch(settings: Any, microbatches: int, seed: int) -> tuple[Any, Any]:
    """`microbatches` x `settings.rows` sequences of `settings.seq_len` tokens below `settings.vocab`
    from a generator seeded `seed`, and their targets (each next token: the tokens rolled left)."""
    import torch

    shape = (microbatches * settings.rows, settings.seq_len)
    tokens = torch.randint(0, settings.vocab, shape, generator=torch.Generator().manual_seed(seed))
    return tokens, tokens.roll(-1, 1)


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """`fn(*args)` on `world` local gloo ranks (`zbcompile.runtime.parallel.local_ranks.run_ranks`), every wait on
    a peer bounded by `timeout_s`; rank r's result at index r; raises if any rank fails."""
    return local_ranks.run_ranks(world, fn, *args, timeout_s=max(timeout_s, 3600.0), group_timeout_s=timeout_s)


def say(line: str) -> None:
    """Print `line` once: on rank 0 where ranks run, else here."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


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


def before_after(data: dict[str, Any]) -> str:
    """The machine's load before and after the run (`data`'s machine_before and machine_after)."""
    return f"{load_line(data['machine_before'])} before, {load_line(data['machine_after'])} after"


def parser(description: str, quick: str, no_write: bool = True) -> argparse.ArgumentParser:
    """Command-line options of a benchmark: `--quick` (a smoke run that writes nothing; its help
    `quick`) and, where `no_write`, `--no-write`; the script adds its own."""
    options = argparse.ArgumentParser(description=description)
    options.add_argument("--quick", action="store_true", help=quick)
    if no_write:
        options.add_argument("--no-write", action="store_true", help="print only; leave the results files alone")
    return options


def writes(options: argparse.Namespace) -> bool:
    """Whether a run of these options writes its results: not with --quick, nor with --no-write."""
    return not options.quick and not getattr(options, "no_write", False)


def write_results(name: str, data: Any, markdown: str, indent: int = 2) -> tuple[pathlib.Path, pathlib.Path]:
    """benchmarks/results/<name>.json (`data`, indented by `indent`) and <name>.md (`markdown`)."""
    RESULTS.mkdir(exist_ok=True)
    json_path = RESULTS / f"{name}.json"
    md_path = RESULTS / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=indent, default=_jsonable) + "\n")
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
    name: str, world: int | None, rank_main: Callable, settings: Any, analyse: Callable, report: Callable, write: bool
) -> None:
    """Run `rank_main(settings)` on `world` ranks (None: once, in this process), print
    `report(data)` and, if `write`, store both under benchmarks/results/<name>.{json,md}. `data`:
    the settings (as a dict), the machine before and after, the run's wall seconds
    (machine_before, machine_after, wall_s), then what `analyse(per_rank, settings)` returns
    (`per_rank`: each rank's result, or the one result; a "settings" of its own replaces the first)."""
    before = machine()
    print(f"machine: {load_line(before)}", flush=True)
    started = time.perf_counter()
    if world is None:
        per_rank = rank_main(settings)
    else:
        per_rank = run_ranks(world, rank_main, settings, timeout_s=settings.timeout_s)
    data = {
        "settings": asdict(settings), "machine_before": before, "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
    }
    data.update(analyse(per_rank, settings))
    print_and_write(name, data, report(data), write)


def print_and_write(name: str, data: dict[str, Any], text: str, write: bool) -> None:
    """Print `text` and, if `write`, store `data` and `text` under benchmarks/results/<name>.{json,md}."""
    print(text)
    if write:
        paths = write_results(name, data, text)
        print("wrote " + ", ".join(str(p) for p in paths))
