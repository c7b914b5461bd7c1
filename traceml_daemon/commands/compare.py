"""`traceml-daemon compare A.db B.db [--json] [--ulp N]`: load two runs, compare, print.

Each database is read through ``store.read.whole_run``: the latest session and
attempt, its ranks' steps and the scalars logged with agent.log. Exit 2 with
the path named when a file is missing or is not a traceml database.
"""

from __future__ import annotations

import argparse
import json
import sys

from traceml_daemon.analysis.diff import compare_runs, format_compare
from traceml_daemon.store.read.whole_run import UnreadableRun, load_run

__all__ = ["add_arguments", "load_run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand's arguments (called by traceml_daemon.commands.cli)."""
    parser.add_argument("a", metavar="A.db", help="the baseline run")
    parser.add_argument("b", metavar="B.db", help="the run compared against A")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--ulp", type=int, default=0, help="scalar tolerance in float64 ULPs (0 = bitwise equal)")


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """Run the comparison: ``args`` parsed by the CLI, or a raw argument list (tests, ``python -m``)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon compare", description="Compare two traceml runs.")
        add_arguments(parser)
        args = parser.parse_args(args)
    if args.ulp < 0:
        print("traceml-daemon compare: --ulp must be >= 0", file=sys.stderr)
        return 2
    try:
        run_a, scalars_a = load_run(args.a)
        run_b, scalars_b = load_run(args.b)
    except UnreadableRun as exc:
        print(f"traceml-daemon compare: {exc}", file=sys.stderr)
        return 2
    result = compare_runs(run_a, run_b, scalars_a, scalars_b, ulp=args.ulp)
    result["a"]["path"], result["b"]["path"] = args.a, args.b
    print(json.dumps(result, indent=2) if args.json else format_compare(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
