"""Is a database whole: SQLite's own checks, then what the daemon's writes guarantee.

SQLite keeps no page checksums, so ``PRAGMA integrity_check`` finds damage to
its structure (b-tree pages, cell pointers, free lists, index entries that no
longer match their rows) but not a changed byte inside a stored value. The
checks after it catch values no writer of this code stores: rows of unknown
ranks, counters that went backwards, durations out of the wire's bounds.
Each check returns the first bad object it finds (table and rowid, or the
message SQLite gave), so ``validate`` can name it. Read-only, stdlib sqlite3.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from traceml_daemon.store.schema import SCHEMA_VERSION
from traceml_wire.bounds import MAX_DURATION_NS
from traceml_wire.tables import TABLES

SQLITE_MAGIC = b"SQLite format 3\x00"
# integrity_check reports at most this many problems: the first is the one named.
_MAX_ERRORS = 20
_TREE = re.compile(r"\b(?:Tree|Page) (\d+)\b")


class DatabaseUnreadable(Exception):
    """The file is missing or cannot be read at all (not a verdict on its contents)."""


@dataclass(frozen=True)
class Problem:
    """The first bad object a check found: what it is and what is wrong with it."""

    check: str
    where: str
    what: str

    def line(self) -> str:
        return f"{self.check}: {self.where}: {self.what}"


@dataclass
class DbReport:
    path: str
    schema_version: int | None = None
    checks_passed: list[str] | None = None
    problem: Problem | None = None
    notes: list[str] | None = None


def open_read_only(path: str) -> sqlite3.Connection:
    """A read-only connection, after making sure the file exists, is readable and is SQLite."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        raise DatabaseUnreadable(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DatabaseUnreadable(f"{path}: is a directory, not a database file") from None
    except OSError as exc:
        raise DatabaseUnreadable(f"{path}: cannot read ({exc.strerror})") from None
    con = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True)
    if head != SQLITE_MAGIC:
        con.close()
        raise _Bad(Problem("header", "file header", "not an SQLite 3 database (bad magic bytes)"))
    return con


class _Bad(Exception):
    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.line())
        self.problem = problem


def validate_db(path: str, quick: bool = False) -> DbReport:
    """Run every check in order and stop at the first problem. Raises DatabaseUnreadable."""
    report = DbReport(path=path, checks_passed=[], notes=[])
    try:
        con = open_read_only(path)
    except _Bad as bad:
        report.problem = bad.problem
        return report
    try:
        for name, check in _checks(quick):
            try:
                problem = check(con, report)
            except sqlite3.DatabaseError as exc:
                # A damaged page often surfaces as an error of the query that reads it.
                problem = Problem(name, "database", f"SQLite error while checking: {exc}")
            if problem is not None:
                report.problem = problem
                return report
            assert report.checks_passed is not None
            report.checks_passed.append(name)
    finally:
        con.close()
    return report


Check = Callable[[sqlite3.Connection, DbReport], "Problem | None"]


def _checks(quick: bool) -> Iterator[tuple[str, Check]]:
    yield ("quick_check" if quick else "integrity_check"), (_quick_check if quick else _integrity_check)
    yield "schema_version", _schema_version
    yield "tables", _tables
    yield "known_ranks", _known_ranks
    yield "ranks", _ranks_rows
    yield "step_order", _step_order
    yield "durations", _durations
    yield "counters", _counters


def _table_of_page(con: sqlite3.Connection, message: str) -> str:
    """'Tree 7 page 9 ...' -> ' (table steps)': which table a b-tree page belongs to, where known."""
    match = _TREE.search(message)
    if match is None:
        return ""
    try:
        row = con.execute("SELECT type, name FROM sqlite_master WHERE rootpage = ?", (int(match.group(1)),)).fetchone()
    except sqlite3.DatabaseError:
        return ""
    return f" ({row[0]} {row[1]})" if row else ""


def _pragma_check(con: sqlite3.Connection, pragma: str) -> Problem | None:
    rows = [r[0] for r in con.execute(f"PRAGMA {pragma}({_MAX_ERRORS})")]
    if rows == ["ok"]:
        return None
    # One row may hold several problems, a line each, under a '*** in database main ***' line.
    lines = [line for r in rows for line in str(r).splitlines() if line and not line.startswith("***")]
    first = lines[0] if lines else "no answer"
    more = f" (and {len(lines) - 1} more problem(s))" if len(lines) > 1 else ""
    return Problem(pragma, "database" + _table_of_page(con, first), f"{first}{more}")


def _integrity_check(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    return _pragma_check(con, "integrity_check")


def _quick_check(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    return _pragma_check(con, "quick_check")


def _schema_version(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in names:
        return Problem("schema_version", "table meta", "missing: not a traceml database")
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        return Problem("schema_version", "meta.schema_version", "missing: not a traceml database")
    try:
        version = int(row[0])
    except (TypeError, ValueError):
        return Problem("schema_version", "meta.schema_version", f"{row[0]!r} is not a number")
    report.schema_version = version
    if version > SCHEMA_VERSION:
        return Problem("schema_version", "meta.schema_version",
                       f"{version} is newer than this traceml-daemon understands ({SCHEMA_VERSION}): upgrade it")
    if version < 1:
        return Problem("schema_version", "meta.schema_version", f"{version} is not a released version")
    if version < SCHEMA_VERSION and report.notes is not None:
        report.notes.append(f"schema version {version} (current {SCHEMA_VERSION}): serve or ingest migrates it")
    return None


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def _present_tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _tables(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    """Every table the daemon writes, with its columns (tables newer than the file's version may be absent)."""
    present = _present_tables(con)
    for table in ("ranks", "delivery"):
        if table not in present:
            return Problem("tables", f"table {table}", "missing")
    for table, spec in TABLES.items():
        if table not in present:
            if report.schema_version == SCHEMA_VERSION and table in _BASE_TABLES:
                return Problem("tables", f"table {table}", "missing")
            continue
        have = set(_columns(con, table))
        # Columns are checked at the current version only: a migration may have appended some.
        current = report.schema_version == SCHEMA_VERSION
        missing = [col for col, _ in spec if col not in have and current]
        if "rank_id" not in have or missing:
            return Problem("tables", f"table {table}", f"missing column(s) {', '.join(missing or ['rank_id'])}")
    return None


# The telemetry tables of schema v1, which every traceml database has (later ones come with their migrations).
_BASE_TABLES = frozenset({"steps", "scalars", "spans", "process", "system", "gpu", "status", "layers", "models",
                          "drops"})


def _telemetry_tables(con: sqlite3.Connection) -> list[str]:
    present = _present_tables(con)
    return [t for t in TABLES if t in present]


def _known_ranks(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    """Every telemetry row belongs to a rank the ranks table knows (rank ids are never deleted)."""
    for table in _telemetry_tables(con):
        row = con.execute(
            f"SELECT rowid, rank_id FROM {table} WHERE rank_id IS NULL "
            "OR rank_id NOT IN (SELECT rank_id FROM ranks) LIMIT 1"
        ).fetchone()
        if row is not None:
            return Problem("known_ranks", f"{table} row {row[0]}", f"rank_id {row[1]} is not in the ranks table")
    return None


def _ranks_rows(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    row = con.execute(
        "SELECT rank_id, last_seq, first_seen, last_seen FROM ranks WHERE last_seq < 0 "
        "OR (first_seen IS NOT NULL AND last_seen IS NOT NULL AND first_seen > last_seen) LIMIT 1"
    ).fetchone()
    if row is None:
        return None
    rank_id, last_seq, first, last = row
    what = f"last_seq {last_seq} is negative" if last_seq < 0 else f"first_seen {first} is after last_seen {last}"
    return Problem("ranks", f"ranks row rank_id {rank_id}", what)


def _step_order(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    """A rank's steps of one model are stored in the order it ran them (batches in seq order, deduplicated)."""
    last: dict[tuple[int, int | None], int] = {}
    for rowid, rank_id, model_id, step in con.execute("SELECT rowid, rank_id, model_id, step FROM steps ORDER BY rowid"):
        if step is None:
            continue
        if step < 0:
            return Problem("step_order", f"steps row {rowid}", f"step {step} is negative")
        key = (rank_id, model_id)
        before = last.get(key)
        if before is not None and step < before:
            return Problem("step_order", f"steps row {rowid}",
                           f"step {step} of rank_id {rank_id} comes after step {before}: steps went backwards")
        last[key] = step
    return None


def _durations(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    """Durations within the bounds ingest enforces (it nulls any beyond them)."""
    cols = [c for c, _ in TABLES["steps"] if c.endswith("_ns")]
    where = " OR ".join(f"{c} < -{MAX_DURATION_NS} OR {c} > {MAX_DURATION_NS}" for c in cols)
    row = con.execute(f"SELECT rowid, {', '.join(cols)} FROM steps WHERE {where} LIMIT 1").fetchone()
    if row is not None:
        bad = next(f"{c} = {v}" for c, v in zip(cols, row[1:], strict=True)
                   if v is not None and not -MAX_DURATION_NS <= v <= MAX_DURATION_NS)
        return Problem("durations", f"steps row {row[0]}", f"{bad} is beyond the bound ingest enforces")
    row = con.execute("SELECT rowid, step_ns FROM steps WHERE step_ns < 0 LIMIT 1").fetchone()
    if row is not None:
        return Problem("durations", f"steps row {row[0]}", f"step_ns {row[1]} is negative")
    return None


def _counters(con: sqlite3.Connection, report: DbReport) -> Problem | None:
    """Cumulative counters: never negative, and an agent's drop counters never go backwards."""
    row = con.execute("SELECT source, counter, value FROM delivery WHERE value < 0 LIMIT 1").fetchone()
    if row is not None:
        return Problem("counters", f"delivery {row[0]!r} {row[1]!r}", f"value {row[2]} is negative")
    last: dict[tuple[int, str], int] = {}
    for rowid, rank_id, source, count in con.execute("SELECT rowid, rank_id, source, count FROM drops ORDER BY rowid"):
        if count is None:
            continue
        before = last.get((rank_id, source))
        if count < 0 or (before is not None and count < before):
            return Problem("counters", f"drops row {rowid}",
                           f"{source} of rank_id {rank_id} went from {before} to {count}: a cumulative counter "
                           "never decreases" if count >= 0 else f"{source} count {count} is negative")
        last[(rank_id, source)] = count
    return None
