"""`traceml-daemon validate --db PATH | --spool DIR`: is a database or a relay spool whole.

``--db`` runs SQLite's integrity check, then the daemon's own invariants
(``store/read/integrity.py``); ``--spool`` reads every record of a spool file or
of a directory's ``*.trs`` files (``ingest/spool_check.py``). The first bad
object is named and the exit code says what was found (``exit_codes``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from traceml_daemon.commands import exit_codes
from traceml_daemon.ingest.spool_check import SpoolUnreadable, validate_spool
from traceml_daemon.store.read.integrity import DatabaseUnreadable, validate_db
from traceml_wire.printable import printable_text

USAGE_EXIT = exit_codes.USAGE  # cli.main maps argparse's usage errors to this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``validate`` subcommand's arguments (called by traceml_daemon.commands.cli)."""
    parser.epilog = exit_codes.VALIDATE_EPILOG
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--db", metavar="PATH", help="check this SQLite database (a copy is fine; read-only)")
    what.add_argument("--spool", metavar="DIR", help="check a relay spool directory (its *.trs files) or one file")
    parser.add_argument("--quick", action="store_true",
                        help="--db: PRAGMA quick_check instead of the full integrity_check (skips index contents)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon validate", description="Check a database or spool.")
        add_arguments(parser)
        try:
            args = parser.parse_args(args)
        except SystemExit as exc:
            return USAGE_EXIT if exc.code == 2 else int(exc.code or 0)
    try:
        result = _validate_db(args.db, args.quick) if args.db else _validate_spool(args.spool)
    except (DatabaseUnreadable, SpoolUnreadable) as exc:
        print(f"traceml-daemon validate: {exc}", file=sys.stderr)
        return exit_codes.IO_ERROR
    ok = result["problem"] is None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(printable_text(result["text"]))
    if not ok:
        print(printable_text(f"traceml-daemon validate: {result['problem']}"), file=sys.stderr)
    return exit_codes.OK if ok else exit_codes.VALIDATION


def _validate_db(path: str, quick: bool) -> dict[str, Any]:
    report = validate_db(path, quick=quick)
    problem = report.problem.line() if report.problem else None
    passed = report.checks_passed or []
    text = f"{path}: " + (f"ok ({len(passed)} checks: {', '.join(passed)})" if problem is None
                          else f"DAMAGED: {problem}")
    for note in report.notes or []:
        text += f"\n  note: {note}"
    if problem is None:
        text += "\n  (SQLite keeps no page checksums: a changed byte inside a stored value that breaks no rule "
        text += "goes unseen)"
    return {"db": path, "schema_version": report.schema_version, "checks_passed": passed,
            "notes": report.notes or [], "problem": problem, "text": text}


def _validate_spool(target: str) -> dict[str, Any]:
    report = validate_spool(target)
    bad = report.first_bad
    problem = None if bad is None else f"{bad.path}: record at byte {bad.bad_offset}: {bad.reason}"
    records = sum(f.records for f in report.files)
    items = sum(f.items for f in report.files)
    if bad is None:
        text = f"{target}: ok ({len(report.files)} spool files, {records} records, {items} agent batches)"
    else:
        text = f"{target}: DAMAGED: {problem} ({bad.records} sound records before it)"
    files = [{"path": f.path, "records": f.records, "items": f.items, "bad_offset": f.bad_offset,
              "reason": f.reason or None} for f in report.files]
    return {"spool": target, "files": files, "problem": problem, "text": text}


if __name__ == "__main__":
    sys.exit(main())
