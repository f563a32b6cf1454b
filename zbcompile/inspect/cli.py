"""`zbcompile inspect DIR`: what the compiler did, read back from a dump (see
`zbcompile.inspect.write`): stages, balance, costs, the schedule's predicted makespan and bubble
against the measured ones, single graphs, the backward before and after the I/W split, and an
HTML report (`zbcompile.inspect.html`).

    zbcompile inspect DIR                      the summary (DIR: a dump root or one compile-<n> in it)
    zbcompile inspect DIR --stage 2 --graph W  one graph (F, I, W, backward; `--graph forward` the traced forward)
    zbcompile inspect DIR --diff [--stage 2]   the backward before and after the split
    zbcompile inspect DIR --html report.html   the report
"""

from __future__ import annotations

import argparse
import os
import sys

from zbcompile.inspect.html import write_report
from zbcompile.inspect.read import GRAPHS, graph_text, load
from zbcompile.inspect.split_diff import split_diff
from zbcompile.inspect.text import summary_text
from zbcompile.inspect.timelines import TRACE_FILE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="what the compiler did: summary, graphs, split, report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", help="a dump: ZBCOMPILE_DUMP's directory or one compile-<n> in it")
    parser.add_argument("--stage", type=int, default=None, help="the stage of --graph (or of --diff)")
    parser.add_argument("--graph", choices=GRAPHS, default=None, help="print one graph")
    parser.add_argument("--diff", action="store_true", help="the backward before and after the I/W split")
    parser.add_argument("--html", default=None, metavar="PATH", help="write the HTML report there")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        dump = load(args.dir)
        if args.graph:
            print(graph_text(dump, args.stage, args.graph), end="")
        elif args.diff:
            if args.stage is not None and not 0 <= args.stage < dump.record["stages"]:
                raise ValueError(
                    f"--stage {args.stage} does not exist: this pipeline has stages 0..{dump.record['stages'] - 1}"
                )
            print(split_diff(dump, args.stage))
        else:
            print(f"{dump.directory}\n")
            print(summary_text(dump))
            if dump.trace is not None:
                print(f"\ntrace (Perfetto, chrome://tracing): {os.path.join(dump.directory, TRACE_FILE)}")
        if args.html:
            print(f"report: {write_report(dump, args.html)}")
    except ValueError as error:
        print(f"zbcompile inspect: {error}", file=sys.stderr)
        return 2
    return 0
