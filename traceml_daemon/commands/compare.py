"""`traceml-daemon compare A B [--json] [--ulp N] [--session ID]`: load two runs, compare, print.

Each side is ``PATH`` or ``PATH:SESSION``, so two jobs of one database compare as
``compare db:job-1 db:job-2``; a side without a session takes ``--session``, else
the latest run. Each is read through ``store.read.whole_run``: the session at its
highest attempt, its ranks' steps and the scalars logged with agent.log.

Exit codes (``exit_codes``), for CI: 0 the runs agree, 1 usage, 2 a file missing,
not a traceml database or without such a session (the path named), 3 a damaged
database, 4 logged scalars or fingerprints diverge beyond ``--ulp``, 5 the step
time median of B is slower than A's by more than ``--fail-on-regression PCT``.
Divergence wins over a regression: a run that computes something else is not
judged on its speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from traceml_daemon.analysis.diff import compare_runs, format_compare
from traceml_daemon.analysis.fingerprints import compare_fingerprints, format_fingerprints
from traceml_daemon.commands import exit_codes, json_out
from traceml_daemon.store.read.whole_run import UnreadableRun, load_fingerprints, load_run, load_session
from traceml_wire.printable import printable_text

__all__ = ["add_arguments", "load_run", "main", "split_side"]

USAGE_EXIT = exit_codes.USAGE  # cli.main maps argparse's usage errors to this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand's arguments (called by traceml_daemon.commands.cli)."""
    parser.add_argument("a", metavar="A", help="the baseline run: PATH or PATH:SESSION")
    parser.add_argument("b", metavar="B", help="the run compared against A: PATH or PATH:SESSION")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--ulp", type=int, default=0, help="scalar tolerance in float64 ULPs (0 = bitwise equal)")
    parser.add_argument("--session", default=None,
                        help="the session of a side that names none (default: each database's latest run)")
    parser.add_argument("--fail-on-regression", type=float, default=None, metavar="PCT",
                        help="exit 5 when B's step time median is more than PCT percent above A's")
    parser.epilog = exit_codes.COMPARE_EPILOG


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
        try:
            args = parser.parse_args(args)
        except SystemExit as exc:
            return USAGE_EXIT if exc.code == 2 else int(exc.code or 0)
    problem = _usage_problem(args)
    if problem:
        print(f"traceml-daemon compare: {problem}", file=sys.stderr)
        return exit_codes.USAGE
    sides = [split_side(args.a), split_side(args.b)]
    try:
        (ref_a, run_a, scalars_a), (ref_b, run_b, scalars_b) = (
            load_session(path, session or args.session) for path, session in sides
        )
    except UnreadableRun as exc:
        hint = " (`traceml-daemon validate --db` names the damage)" if exc.damaged else ""
        print(f"traceml-daemon compare: {exc}{hint}", file=sys.stderr)
        return exit_codes.VALIDATION if exc.damaged else exit_codes.IO_ERROR
    try:
        fp_a, fp_b = load_fingerprints(sides[0][0], ref_a), load_fingerprints(sides[1][0], ref_b)
    except UnreadableRun as exc:
        print(f"traceml-daemon compare: {exc}", file=sys.stderr)
        return exit_codes.VALIDATION if exc.damaged else exit_codes.IO_ERROR
    result = compare_runs(run_a, run_b, scalars_a, scalars_b, ulp=args.ulp)
    result["fingerprints"] = compare_fingerprints(fp_a, fp_b, args.ulp)
    for key, (path, _session), ref in (("a", sides[0], ref_a), ("b", sides[1], ref_b)):
        result[key].update(path=path, session=ref.session, attempt=ref.attempt)
    code = outcome(result, args.fail_on_regression)
    result["exit_code"] = code
    print(json_out.dumps(result, indent=2) if args.json else _with_runs(format_compare(result), result))
    return code


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.ulp < 0:
        return "--ulp must be >= 0"
    pct = args.fail_on_regression
    if pct is not None and not (pct >= 0 and pct != float("inf")):
        return f"--fail-on-regression takes a percentage >= 0, got {pct}"
    return None


def outcome(result: dict[str, Any], fail_on_regression: float | None) -> int:
    """The exit code of a comparison: 4 diverged, else 5 slower beyond the threshold, else 0."""
    if result["scalars"]["first_divergence"] is not None or (result.get("fingerprints") or {}).get("first_divergence"):
        return exit_codes.DIVERGED
    if fail_on_regression is not None:
        step = next(row for row in result["deltas"] if row["metric"] == "step")
        if step["delta_pct"] is not None and step["delta_pct"] > fail_on_regression:
            return exit_codes.REGRESSION
    return exit_codes.OK


def _with_runs(text: str, result: dict[str, Any]) -> str:
    """The comparison's text under a line per run (sessions are peer text: printable only)."""
    names = [f"{k.upper()}: {result[k]['path']} session {result[k]['session']} attempt {result[k]['attempt']}"
             for k in ("a", "b")]
    return printable_text("\n".join(names)) + "\n" + text + "\n" + format_fingerprints(result["fingerprints"])


if __name__ == "__main__":
    sys.exit(main())
