"""Which run: sessions and attempts in the ``ranks`` table, a run's parallelism and time bounds."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from traceml_daemon.store.read.connect import connect_file, has_table
from traceml_daemon.store.schema import rank_is


@dataclass(frozen=True)
class RunRef:
    session: str
    attempt: int


def latest_run(conn: sqlite3.Connection) -> RunRef | None:
    """The session seen most recently, at its highest attempt (torchelastic restarts)."""
    row = conn.execute(
        "SELECT session FROM ranks GROUP BY session ORDER BY max(coalesce(last_seen, first_seen, 0)) DESC LIMIT 1"
    ).fetchone()
    if row is None:
        return None
    (attempt,) = conn.execute("SELECT max(attempt) FROM ranks WHERE session=?", (row[0],)).fetchone()
    return RunRef(row[0], int(attempt or 0))


def current_run(conn: sqlite3.Connection) -> RunRef | None:
    """``latest_run``, or None while the daemon has not created its tables yet (a live view
    may open the database first). A late resend from an earlier attempt (an elastic
    restart) refreshes that attempt's last_seen but does not make it the current run."""
    if not has_table(conn, "ranks"):
        return None
    return latest_run(conn)


def list_runs(conn: sqlite3.Connection) -> list[RunRef]:
    rows = conn.execute(
        "SELECT session, attempt FROM ranks GROUP BY session, attempt ORDER BY min(first_seen)"
    ).fetchall()
    return [RunRef(s, int(a)) for s, a in rows]


def session_names(conn: sqlite3.Connection) -> list[str]:
    return [row[0] for row in conn.execute("SELECT DISTINCT session FROM ranks ORDER BY session")]


def run_last_seen(conn: sqlite3.Connection, run: RunRef) -> float | None:
    """When the daemon last heard from any rank of ``run`` (liveness)."""
    return conn.execute(
        "SELECT MAX(last_seen) FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
    ).fetchone()[0]


def run_bounds(conn: sqlite3.Connection, run: RunRef) -> tuple[float | None, float | None]:
    """(started_at, ended_at) wall clock: first and last step end, else first/last seen.

    Each rank's first and last step through the steps index, two lookups per rank:
    ``min(ts)`` over the run's rows read every row of a long run."""
    ends = conn.execute(
        f"SELECT (SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step LIMIT 1), "
        f"(SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step DESC LIMIT 1) "
        "FROM ranks r WHERE r.session=? AND r.attempt=?",
        (run.session, run.attempt),
    ).fetchall()
    firsts = [a for a, _ in ends if a is not None]
    lasts = [b for _, b in ends if b is not None]
    seen = conn.execute(
        "SELECT min(first_seen), max(last_seen) FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
    ).fetchone()
    return (min(firsts) if firsts else seen[0], max(lasts) if lasts else seen[1])


def run_parallelism(conn: sqlite3.Connection, run: RunRef, hello: Iterable[str | None] | None = None) -> str:
    """fsdp2 > ddp > single, from the traced models, else the hello identity.

    ``hello``: the ranks' hello parallelism when the caller has read the rows already.
    """
    found = {
        row[0]
        for row in conn.execute(
            "SELECT DISTINCT m.parallelism FROM models m JOIN ranks r USING (rank_id) WHERE r.session=? AND r.attempt=?",
            (run.session, run.attempt),
        )
    }
    if hello is None:
        hello = [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT parallelism FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
            )
        ]
    found |= set(hello)
    for kind in ("fsdp2", "ddp"):
        if kind in found:
            return kind
    return "single"


# Per node other than 0, the ranks first stored since a time (so an older run in the
# same file never counts) and whether each sent its last batch.
_OTHER_NODES_RANKS = """
SELECT r.node_rank, r.attempt, r.local_world_size, r.last_seen,
       coalesce((SELECT max(s.finished) FROM status s WHERE s.rank_id = r.rank_id), 0)
FROM ranks r WHERE r.first_seen >= ? AND r.node_rank > 0
"""


def other_nodes_ranks(db: str, since: float) -> list[tuple[int, int | None, int | None, float | None, int]]:
    """(node_rank, attempt, local_world_size, last_seen, finished) of every rank of
    nodes 1.. first stored at or after ``since``; empty while nothing is stored yet."""
    try:
        conn = connect_file(Path(db))
        try:
            return conn.execute(_OTHER_NODES_RANKS, (since,)).fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return []  # no database yet, or its schema is still being created
