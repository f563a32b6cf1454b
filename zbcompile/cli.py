"""The `zbcompile` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module exposing `register(subparsers)`; the module's parser sets `func`.
SUBCOMMANDS = {
    "schedule": "zbcompile.schedules.cli",
    "demo": "zbcompile.demo",
    "inspect": "zbcompile.inspect.cli",
    "plan": "zbcompile.planner.cli",
    "rehearse": "zbcompile.rehearsal.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zbcompile", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
