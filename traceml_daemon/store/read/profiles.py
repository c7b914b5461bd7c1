"""Reads behind `traceml-daemon profile`: where the profiles table stands, what a rank
reported since, and when the rank's data last arrived (index seeks only)."""

from __future__ import annotations

import sqlite3


def _marks(values: list[int]) -> str:
    return ",".join("?" * len(values))


def profiles_mark(conn: sqlite3.Connection) -> int:
    """The highest profiles rowid now (0: none, or no table yet)."""
    try:
        (mark,) = conn.execute("SELECT coalesce(max(rowid), 0) FROM profiles").fetchone()
    except sqlite3.OperationalError:
        return 0
    return int(mark)


def profiles_after(conn: sqlite3.Connection, rank_ids: list[int], after: int) -> list[tuple[int, int, str]]:
    """(first step, steps, path) of the trace files these rank ids reported after rowid ``after``."""
    if not rank_ids:
        return []
    try:
        rows = conn.execute(
            f"SELECT step, steps, path FROM profiles WHERE rowid > ? AND rank_id IN ({_marks(rank_ids)}) ORDER BY rowid",
            [after, *rank_ids],
        ).fetchall()
    except sqlite3.OperationalError:
        return []
    return [(int(step), int(steps or 1), str(path)) for step, steps, path in rows if path and step is not None]


def last_seen(conn: sqlite3.Connection, rank_ids: list[int]) -> float | None:
    """When data of these rank ids last arrived (the ranks table's last_seen)."""
    if not rank_ids:
        return None
    (seen,) = conn.execute(f"SELECT max(last_seen) FROM ranks WHERE rank_id IN ({_marks(rank_ids)})", rank_ids).fetchone()
    return seen
