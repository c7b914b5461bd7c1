"""`traceml-daemon compare A B [--json] [--ulp N] [--session ID]`: load two runs, compare, print.

Each side is ``PATH`` or ``PATH:SESSION``, so two jobs of one database compare as
``compare db:job-1 db:job-2``; a side without a session takes ``--session``, else
the latest run. Each is read through ``store.read.whole_run``: the session at its
highest attempt, its ranks' steps and the scalars logged with agent.log. Exit 2
with the path named when a file is missing, is not a traceml database, or holds
no such session.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from traceml_daemon.analysis.diff import compare_runs, format_compare
from traceml_daemon.store.read.whole_run import UnreadableRun, load_run, load_session
from traceml_wire.printable import printable_text

__all__ = ["add_arguments", "load_run", "main", "split_side"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand's arguments (called by traceml_daemon.commands.cli)."""
    parser.add_argument("a", metavar="A", help="the baseline run: PATH or PATH:SESSION")
    parser.add_argument("b", metavar="B", help="the run compared against A: PATH or PATH:SESSION")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--ulp", type=int, default=0, help="scalar tolerance in float64 ULPs (0 = bitwise equal)")
    parser.add_argument("--session", default=None,
                        help="the session of a side that names none (default: each database's latest run)")


def split_side(text: str) -> tuple[str, str | None]:
    """``PATH`` or ``PATH:SESSION`` -> (path, session or None).

    A path that exists as a file wins, so a file named ``a:b.db`` is that file; else
    the longest prefix before a ``:`` that is a file is the path (session ids may
    hold ``:``, e.g. ``host:port``). With no such prefix the text is the path, and
    reading it says that no such file exists.
    """
    if os.path.isfile(text) or ":" not in text:
        return text, None
    cut = len(text)
    while (cut := text.rfind(":", 0, cut)) > 0:
        if os.path.isfile(text[:cut]):
            return text[:cut], text[cut + 1 :] or None
    return text, None


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """Run the comparison: ``args`` parsed by the CLI, or a raw argument list (tests, ``python -m``)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon compare", description="Compare two traceml runs.")
        add_arguments(parser)
        args = parser.parse_args(args)
    if args.ulp < 0:
        print("traceml-daemon compare: --ulp must be >= 0", file=sys.stderr)
        return 2
    sides = [split_side(args.a), split_side(args.b)]
    try:
        (ref_a, run_a, scalars_a), (ref_b, run_b, scalars_b) = (
            load_session(path, session or args.session) for path, session in sides
        )
    except UnreadableRun as exc:
        print(f"traceml-daemon compare: {exc}", file=sys.stderr)
        return 2
    result = compare_runs(run_a, run_b, scalars_a, scalars_b, ulp=args.ulp)
    for key, (path, _session), ref in (("a", sides[0], ref_a), ("b", sides[1], ref_b)):
        result[key].update(path=path, session=ref.session, attempt=ref.attempt)
    print(json.dumps(result, indent=2) if args.json else _with_runs(format_compare(result), result))
    return 0


def _with_runs(text: str, result: dict[str, Any]) -> str:
    """The comparison's text under a line per run (sessions are peer text: printable only)."""
    names = [f"{k.upper()}: {result[k]['path']} session {result[k]['session']} attempt {result[k]['attempt']}"
             for k in ("a", "b")]
    return printable_text("\n".join(names)) + "\n" + text


if __name__ == "__main__":
    sys.exit(main())
