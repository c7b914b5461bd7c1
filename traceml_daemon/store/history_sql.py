"""History's tables as SQL: the columns, and the upserts that merge new stats in.

A bucket row met again (a bucket filled over several writes, or across a restart)
merges in SQL: counts and sums add, minima and maxima take the extreme, NULL
meaning "no value yet". Sums saturate at the int64 bounds, as in Python
(``history_buckets``): SQLite turns an integer ``a + b`` that overflows into a
REAL (which a column then keeps), so ``_saturating_add`` never computes a sum
beyond the range, and pins a REAL an older daemon stored that way back to its
bound. Each statement is given as ``SqlParts`` so the writer puts
many rows in one statement (``store/statements.py``); the single-row forms are
for ``executemany`` (``bench/history.py``).
"""

from __future__ import annotations

from typing import Any

from traceml_daemon.store.history_buckets import Stats
from traceml_daemon.store.schema import HISTORY_METRICS
from traceml_daemon.store.statements import SqlParts, one_row_sql
from traceml_wire.bounds import INT64_MAX, INT64_MIN
from traceml_wire.tables import PHASES

# A bucket row's stats columns, in ``Stats`` order.
STAT_COLUMNS = ("n", "first_step", "last_step", "last_ts") + tuple(
    f"{m}_{k}" for m in HISTORY_METRICS for k in ("n", "min", "max", "sum")
)
# A reservoir row: its key, then a point's history columns.
RESERVOIR_COLUMNS = ("rank_id", "slot", "step", "ts", "step_ns", *(f"{p}_ns" for p in PHASES))


# INT64_MIN as an SQL literal: "-9223372036854775808" parses as the negation of a
# number too large for an integer, a REAL.
_MAX_SQL, _MIN_SQL = str(INT64_MAX), f"({INT64_MIN + 1} - 1)"


def saturating_add(have: str, add: str) -> str:
    """SQL for ``have + add`` pinned to the int64 range. Each branch compares against a
    bound minus ``add`` on the side where that cannot overflow; a ``have`` beyond the
    range (a REAL an older daemon's overflowing ``+`` stored) lands on its bound."""
    return (
        f"CASE WHEN {add} >= 0 THEN CASE WHEN {have} > {_MAX_SQL} - {add} THEN {_MAX_SQL} "
        f"WHEN {have} < {_MIN_SQL} THEN {_MIN_SQL} ELSE {have} + {add} END "
        f"ELSE CASE WHEN {have} < {_MIN_SQL} - {add} THEN {_MIN_SQL} "
        f"WHEN {have} > {_MAX_SQL} THEN {_MAX_SQL} ELSE {have} + {add} END END"
    )


def _merge_sql(col: str) -> str:
    # NULL means "no value yet"; SQL's multi-argument min/max would return NULL.
    if col.endswith("_min") or col == "first_step":
        return f"{col}=min(coalesce({col}, excluded.{col}), coalesce(excluded.{col}, {col}))"
    if col.endswith("_max") or col in ("last_step", "last_ts"):
        return f"{col}=max(coalesce({col}, excluded.{col}), coalesce(excluded.{col}, {col}))"
    if col.endswith("_sum"):
        return f"{col}={saturating_add(col, f'excluded.{col}')}"
    return f"{col}={col}+excluded.{col}"  # counts: each at most the steps stored


def _upsert_parts(table: str, keys: tuple[str, ...]) -> SqlParts:
    cols = keys + STAT_COLUMNS
    return (
        f"INSERT INTO {table} ({', '.join(cols)})",
        f"ON CONFLICT({', '.join(keys)}) DO UPDATE SET {', '.join(_merge_sql(c) for c in STAT_COLUMNS)}",
        len(cols),
    )


RANK_UPSERT_PARTS = _upsert_parts("rank_history", ("rank_id", "level", "bucket"))
NODE_UPSERT_PARTS = _upsert_parts("node_history", ("session", "attempt", "node_rank", "level", "bucket"))
RESERVOIR_UPSERT_PARTS: SqlParts = (
    f"INSERT OR REPLACE INTO reservoir ({', '.join(RESERVOIR_COLUMNS)})", "", len(RESERVOIR_COLUMNS)
)
RESERVOIR_STATE_UPSERT_PARTS: SqlParts = (
    "INSERT OR REPLACE INTO reservoir_state (rank_id, seen, next_take, w, size)", "", 5
)
RANK_UPSERT = one_row_sql(RANK_UPSERT_PARTS)
NODE_UPSERT = one_row_sql(NODE_UPSERT_PARTS)
RESERVOIR_UPSERT = one_row_sql(RESERVOIR_UPSERT_PARTS)
RESERVOIR_STATE_UPSERT = one_row_sql(RESERVOIR_STATE_UPSERT_PARTS)


def history_rows(deltas: dict[Any, Stats]) -> list[tuple[Any, ...]]:
    return [(*key, *stats) for key, stats in deltas.items()]
