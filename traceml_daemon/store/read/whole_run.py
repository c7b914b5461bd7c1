"""One whole run, every step and every logged scalar, for ``compare``: a session named by the
caller, else the latest run (``runs.resolve_run``, as every reader chooses).

Compare needs exact values at every step (the first divergent one), so it reads
each rank's steps in full instead of the windows and samples the other readers
use; the stdlib sqlite3 module, read-only, so a live daemon may still be writing.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from traceml_daemon.analysis.fingerprints import Series
from traceml_daemon.analysis.model import PHASES, RankData, RunData
from traceml_daemon.analysis.scalars import first_nonfinite, scalar_key
from traceml_daemon.store.gc_pause import gc_paused
from traceml_daemon.store.read import fingerprints, fsdp2
from traceml_daemon.store.read.runs import RunRef, UnknownSession, resolve_run
from traceml_daemon.store.schema import RANK_GROUP

Scalars = dict[str, list[tuple[int, float]]]

_STEP_COLS = (
    "step",
    "ts",
    "step_ns",
    *(f"{p}_ns" for p in PHASES),
    "comm_ns",
    "peak_bytes",
    "reserved_bytes",
    "rss_bytes",
)


class UnreadableRun(Exception):
    """A database whose run cannot be loaded; the message names its path. ``damaged``: the file
    is an SQLite database that SQLite found malformed (validation failure, not I/O)."""

    def __init__(self, message: str, damaged: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged


def _is_damage(exc: sqlite3.DatabaseError) -> bool:
    return "malformed" in str(exc) or isinstance(exc, sqlite3.IntegrityError)


def _connect(path: str) -> sqlite3.Connection:
    p = Path(path)
    if not p.is_file():
        raise UnreadableRun(f"{path}: no such file")
    try:
        con = sqlite3.connect(f"file:{quote(str(p.resolve()))}?mode=ro", uri=True)
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise UnreadableRun(f"{path}: not a traceml database ({exc})", _is_damage(exc)) from None
    missing = {"ranks", "steps", "scalars", "models"} - tables
    if missing:
        con.close()
        raise UnreadableRun(f"{path}: not a traceml database (no {', '.join(sorted(missing))} table)")
    return con


def load_run(path: str, session: str | None = None) -> tuple[RunData, Scalars]:
    """``session`` (default: the latest run) of the database at ``path`` as RunData, plus its scalars."""
    _run, data, scalars = load_session(path, session)
    return data, scalars


def load_session(path: str, session: str | None = None) -> tuple[RunRef, RunData, Scalars]:
    """``load_run`` and which run it read: ``session`` at its highest attempt, else the latest."""
    con = _connect(path)
    try:
        with gc_paused():  # every step row of a run, acyclic (see gc_pause)
            return _load(con, path, session)
    except sqlite3.DatabaseError as exc:
        raise UnreadableRun(f"{path}: cannot read ({exc})", _is_damage(exc)) from None
    finally:
        con.close()


def _load(con: sqlite3.Connection, path: str, wanted: str | None) -> tuple[RunRef, RunData, Scalars]:
    try:
        run = resolve_run(con, wanted)
    except UnknownSession as exc:
        raise UnreadableRun(f"{path}: {exc}") from None
    if run is None:
        raise UnreadableRun(f"{path}: no ranks recorded")
    session, attempt = run.session, run.attempt
    ranks: dict[int, RankData] = {}
    parallelism = "single"
    for rank_id, global_rank, local_rank, node_rank, hostname, par in con.execute(
        "SELECT rank_id, global_rank, local_rank, node_rank, hostname, parallelism FROM ranks "
        "WHERE session = ? AND attempt = ? ORDER BY global_rank, rank_id",
        (session, attempt),
    ):
        ranks[rank_id] = RankData(
            global_rank=global_rank if global_rank is not None else rank_id,
            local_rank=local_rank,
            node_rank=node_rank,
            hostname=hostname,
        )
        parallelism = par or parallelism
    parallelism = _parallelism(con, session, attempt, parallelism)
    cols = ", ".join(f"s.{c}" for c in _STEP_COLS)
    last: tuple[int, int] | None = None
    # ORDER BY model_id: with two traced models, the first one's row stands for the step.
    # The rest of the order is the steps index's (rank group, step, rank), so no sort of
    # the whole run: each rank's steps still arrive in step order, its duplicates together.
    for row in con.execute(
        f"SELECT s.rank_id, {cols} FROM steps s JOIN ranks r ON r.rank_id = s.rank_id "
        f"WHERE r.session = ? AND r.attempt = ? ORDER BY s.rank_id / {RANK_GROUP}, s.step, s.rank_id, s.model_id",
        (session, attempt),
    ):
        rank_id, values = row[0], dict(zip(_STEP_COLS, row[1:], strict=True))
        if values["step"] is None or (rank_id, values["step"]) == last:
            continue
        last = (rank_id, values["step"])
        _append_step(ranks[rank_id], values)
    scalars: Scalars = {}
    for global_rank, step, name, value in con.execute(
        "SELECT COALESCE(r.global_rank, r.rank_id), s.step, s.name, s.value FROM scalars s "
        "JOIN ranks r ON r.rank_id = s.rank_id WHERE r.session = ? AND r.attempt = ? "
        "AND s.step IS NOT NULL AND s.value IS NOT NULL ORDER BY s.name, r.global_rank, s.step, s.rowid",
        (session, attempt),
    ):
        scalars.setdefault(scalar_key(name, global_rank), []).append((step, float(value)))
    if parallelism == "fsdp2":  # the collective wait that tells a straggler from the ranks waiting for it
        fsdp2.fill_steps(con, list(ranks.items()))
    data = RunData(ranks=list(ranks.values()), parallelism=parallelism, nonfinite=first_nonfinite(scalars),
                   fingerprints=fingerprints.evidence(con, run))
    return run, data, scalars


def load_fingerprints(path: str, run: RunRef) -> Series:
    """Every fingerprint of ``run`` (``load_session``'s), for compare's first divergent step and layer."""
    con = _connect(path)
    try:
        with gc_paused():
            return fingerprints.series(con, run)
    except sqlite3.DatabaseError as exc:
        raise UnreadableRun(f"{path}: cannot read ({exc})", _is_damage(exc)) from None
    finally:
        con.close()


def _parallelism(con: sqlite3.Connection, session: str, attempt: int, hello: str) -> str:
    """fsdp2 > ddp > single: the traced models know better than the rank's hello."""
    found = {hello}
    found |= {
        row[0]
        for row in con.execute(
            "SELECT DISTINCT m.parallelism FROM models m JOIN ranks r ON r.rank_id = m.rank_id "
            "WHERE r.session = ? AND r.attempt = ?",
            (session, attempt),
        )
    }
    return next((kind for kind in ("fsdp2", "ddp") if kind in found), "single")


def _append_step(rank: RankData, v: dict[str, Any]) -> None:
    rank.steps.append(v["step"])
    rank.step_ts.append(v["ts"])
    rank.step_ns.append(v["step_ns"])
    for p in PHASES:
        rank.phases_ns.setdefault(p, []).append(v[f"{p}_ns"])
    rank.comm_ns.append(v["comm_ns"])
    rank.peak_bytes.append(v["peak_bytes"])
    rank.reserved_bytes.append(v["reserved_bytes"])
    rank.rss_bytes.append(v["rss_bytes"])
