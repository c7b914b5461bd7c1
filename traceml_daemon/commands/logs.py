"""`traceml-daemon logs --db PATH [--session ID] [--rank R] [--grep RE] [--follow] [--json]`.

The ranks' captured stdout and stderr, identical lines folded across ranks
(``[ranks 0-63 x12] warning: ...``), tracebacks and errors first. Reads each
rank's newest lines (a share of ``--max-lines``) through the read layer;
``--follow`` then prints what arrives, folded per poll.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.output_fold import Folded, OutputLine, fold, render
from traceml_daemon.store import reader
from traceml_daemon.store.read import output
from traceml_daemon.store.read.connect import data_version
from traceml_wire.printable import printable_text

DEFAULT_DB = "traceml.db"
DEFAULT_MAX_LINES = 200_000  # lines read at most, shared by the ranks shown
MIN_LINES_PER_RANK = 200
FOLLOW_POLL_S = 0.5
FOLLOW_BATCH = 50_000  # lines read per poll at most; the rest come at the next


class LogsError(Exception):
    """A mistake the user can fix (unknown rank, bad pattern): exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    parser.add_argument("--session", default=None, help="this session (default: the latest run; `runs` lists them)")
    parser.add_argument("--rank", type=int, default=None, help="only this global rank")
    parser.add_argument("--grep", default=None, metavar="RE", help="only lines matching this regular expression")
    parser.add_argument("--follow", action="store_true", help="keep printing new lines as they arrive (Ctrl-C stops)")
    parser.add_argument("--json", action="store_true", help="print JSON (with --follow: one object per line)")
    parser.add_argument("--max-lines", type=int, default=DEFAULT_MAX_LINES,
                        help=f"lines read at most, shared by the ranks (default {DEFAULT_MAX_LINES:,})")


@dataclass
class Selection:
    """The run's ranks shown: rank_id -> global rank."""

    run: reader.RunRef
    ranks: dict[int, int]


def select(conn: sqlite3.Connection, session: str | None, rank: int | None) -> Selection | None:
    """The run and ranks to show (None: nothing stored yet). Raises UnknownSession, LogsError."""
    run = reader.resolve_run(conn, session)
    if run is None:
        return None
    rows = reader.load_ranks(conn, run)
    ranks = {r.rank_id: _global(r) for r in rows}
    if rank is not None:
        ranks = {k: g for k, g in ranks.items() if g == rank}
        if not ranks:
            from traceml_daemon.analysis.stats import rank_ranges

            raise LogsError(f"rank {rank} is not in session {run.session} (ranks {rank_ranges(_global(r) for r in rows)})")
    return Selection(run, ranks)


def _global(row: reader.RankRow) -> int:
    return int(row.global_rank if row.global_rank is not None else -row.rank_id)


def matcher(pattern: str | None) -> Callable[[str], bool]:
    if pattern is None:
        return lambda text: True
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise LogsError(f"--grep {pattern!r} is not a regular expression: {exc}") from None
    return lambda text: compiled.search(text) is not None


def read_lines(conn: sqlite3.Connection, sel: Selection, max_lines: int) -> list[OutputLine]:
    """Each selected rank's newest lines, an equal share of ``max_lines`` each."""
    if not output.has_output(conn):
        return []
    share = max(MIN_LINES_PER_RANK, max_lines // max(1, len(sel.ranks)))
    out: list[OutputLine] = []
    for rank_id, global_rank in sel.ranks.items():
        out += [OutputLine(global_rank, ts, stream, seq, line) for ts, stream, seq, line in
                output.rank_output(conn, rank_id, share)]
    return out


def folded_lines(lines: Iterable[OutputLine], keep: Callable[[str], bool]) -> list[Folded]:
    """Fold first, then keep the entries whose text matches (a traceback matches on any line)."""
    return [e for e in fold(lines) if keep(e.text)]


def report(db_path: str, session: str | None, rank: int | None, pattern: str | None,
           max_lines: int = DEFAULT_MAX_LINES) -> dict[str, Any]:
    """The folded output as a JSON-able dict. Raises StoreError, UnknownSession, LogsError."""
    keep = matcher(pattern)
    conn = reader.open_readonly(db_path)
    try:
        sel = select(conn, session, rank)
        if sel is None:
            return {"session": None, "lines_read": 0, "entries": []}
        lines = read_lines(conn, sel, max_lines)
        entries = folded_lines(lines, keep)
        return {
            "session": sel.run.session,
            "attempt": sel.run.attempt,
            "ranks": len(sel.ranks),
            "lines_read": len(lines),
            "entries": [e.to_json() for e in entries],
        }
    finally:
        conn.close()


def render_text(rep: dict[str, Any]) -> str:
    if rep["session"] is None:
        return "(nothing stored yet)\n"
    entries = [_entry(e) for e in rep["entries"]]
    head = (f"Output of session {rep['session']} (attempt {rep['attempt']}): {rep['lines_read']:,} lines "
            f"of {rep['ranks']} rank(s), {len(entries)} distinct; tracebacks and errors first")
    body = render(entries) if entries else ["(no output captured)"]
    # Rank output is peer text: no escape sequence reaches the terminal.
    return printable_text("\n".join([head, *body])) + "\n"


def _entry(e: dict[str, Any]) -> Folded:
    return Folded(e["text"], e["kind"], e["stream"], e["first_ts"], e["last_ts"], e["count"], set(e["ranks"]))


def start_rowid(db_path: str) -> int:
    """Where ``follow`` starts: the newest line stored now (read before the first report,
    so a line stored meanwhile is printed twice at worst, never missed)."""
    conn = reader.open_readonly(db_path)
    try:
        return output.last_output_rowid(conn) if output.has_output(conn) else 0
    finally:
        conn.close()


def follow(db_path: str, sel: Selection, keep: Callable[[str], bool], as_json: bool,
           write: Callable[[str], None], last: int, stop: Callable[[], bool] = lambda: False) -> None:
    """Print the lines stored after rowid ``last``, folded per poll, until ``stop()`` or Ctrl-C."""
    conn = reader.open_readonly(db_path)
    try:
        seen = -1  # the first poll reads whatever came after ``last``
        while not stop():
            time.sleep(FOLLOW_POLL_S)
            version = data_version(conn)
            if version == seen:
                continue
            seen = version
            lines: list[OutputLine] = []
            read = 0
            for rowid, rank_id, ts, stream, seq, line in output.output_after(conn, last, FOLLOW_BATCH):
                last = rowid
                read += 1
                global_rank = sel.ranks.get(rank_id)
                if global_rank is not None:
                    lines.append(OutputLine(global_rank, ts, stream, seq, line))
            if read == FOLLOW_BATCH:
                seen = -1  # more are waiting: read on at the next poll
            if lines:
                entries = folded_lines(lines, keep)
                if as_json:
                    write("".join(json.dumps(e.to_json()) + "\n" for e in entries))
                else:
                    write(printable_text("\n".join(render(entries))) + "\n")
    finally:
        conn.close()


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon logs", description="Rank output, folded across ranks.")
        add_arguments(parser)
        args = parser.parse_args(args)
    if args.max_lines < 1:
        print("traceml-daemon logs: --max-lines must be at least 1", file=sys.stderr)
        return 2
    try:
        last = start_rowid(args.db) if args.follow else 0
        rep = report(args.db, args.session, args.rank, args.grep, args.max_lines)
        if args.json and not args.follow:
            json.dump(rep, sys.stdout, indent=2)
            sys.stdout.write("\n")
        elif args.json:
            sys.stdout.write("".join(json.dumps(e) + "\n" for e in rep["entries"]))
        else:
            sys.stdout.write(render_text(rep))
        sys.stdout.flush()
        if args.follow:
            conn = reader.open_readonly(args.db)
            try:
                sel = select(conn, args.session, args.rank)
            finally:
                conn.close()
            if sel is None:
                print("traceml-daemon logs: nothing stored yet to follow", file=sys.stderr)
                return 2

            def write(text: str) -> None:
                sys.stdout.write(text)
                sys.stdout.flush()

            follow(args.db, sel, matcher(args.grep), args.json, write, last)
    except (reader.StoreError, LogsError) as exc:
        print(f"traceml-daemon logs: {exc}", file=sys.stderr)
        return 2
    except reader.UnknownSession as exc:
        print(f"traceml-daemon logs: {args.db}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
