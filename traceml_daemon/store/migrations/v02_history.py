"""v2: downsampled history, backfilled from the raw steps a v1 database holds.

The writer maintains it as steps arrive (store/history.py), so an overview of a
run of any length reads O(width) rows per series and survives retention deleting
raw steps. Levels, metrics and the reservoir's size: store/schema.py."""

from __future__ import annotations

from traceml_daemon.store.schema import HISTORY_LEVELS, HISTORY_METRICS, LATEST_SLOT, RESERVOIR_SIZE
from traceml_wire.tables import PHASES


def metric_columns() -> str:
    """The four aggregate columns of every history metric (v3 rebuilds the tables with them)."""
    # n counts non-NULL values (NULL = not measured) so mean = sum / n stays exact
    # when buckets are merged across transactions.
    return ", ".join(
        f"{m}_n INTEGER NOT NULL DEFAULT 0, {m}_min INTEGER, {m}_max INTEGER, {m}_sum INTEGER NOT NULL DEFAULT 0"
        for m in HISTORY_METRICS
    )


def _history_select(level: int) -> str:
    aggs = ", ".join(
        f"count({m}_ns), min({m}_ns), max({m}_ns), coalesce(sum({m}_ns), 0)" for m in HISTORY_METRICS
    )
    return f"{level}, step / {level}, count(*), min(step), max(step), max(ts), {aggs}"


def statements() -> list[str]:
    metrics = metric_columns()
    cols = ", ".join(f"{m}_n, {m}_min, {m}_max, {m}_sum" for m in HISTORY_METRICS)
    node_aggs = ", ".join(f"sum({m}_n), min({m}_min), max({m}_max), sum({m}_sum)" for m in HISTORY_METRICS)
    phase_cols = ", ".join(f"{p}_ns" for p in PHASES)
    out = [
        f"""CREATE TABLE IF NOT EXISTS rank_history (
            rank_id INTEGER NOT NULL, level INTEGER NOT NULL, bucket INTEGER NOT NULL,
            n INTEGER NOT NULL, first_step INTEGER, last_step INTEGER, last_ts REAL, {metrics},
            PRIMARY KEY (rank_id, level, bucket)
        ) WITHOUT ROWID""",
        f"""CREATE TABLE IF NOT EXISTS node_history (
            session TEXT NOT NULL, attempt INTEGER NOT NULL, node_rank INTEGER NOT NULL,
            level INTEGER NOT NULL, bucket INTEGER NOT NULL,
            n INTEGER NOT NULL, first_step INTEGER, last_step INTEGER, last_ts REAL, {metrics},
            PRIMARY KEY (session, attempt, node_rank, level, bucket)
        ) WITHOUT ROWID""",
        f"""CREATE TABLE IF NOT EXISTS reservoir (
            rank_id INTEGER NOT NULL, slot INTEGER NOT NULL,
            step INTEGER, ts REAL, step_ns INTEGER, {", ".join(f"{p}_ns INTEGER" for p in PHASES)},
            PRIMARY KEY (rank_id, slot)
        ) WITHOUT ROWID""",
        # Reservoir sampling state (Algorithm L), so a restarted daemon samples on uniformly.
        """CREATE TABLE IF NOT EXISTS reservoir_state (
            rank_id INTEGER PRIMARY KEY, seen INTEGER NOT NULL, next_take INTEGER NOT NULL, w REAL NOT NULL
        )""",
    ]
    # Backfill from the raw steps a v1 database already holds (pure SQL, one pass per level).
    for level in HISTORY_LEVELS:
        out.append(
            f"INSERT OR REPLACE INTO rank_history (rank_id, level, bucket, n, first_step, last_step, last_ts, {cols}) "
            f"SELECT rank_id, {_history_select(level)} FROM steps WHERE step IS NOT NULL GROUP BY rank_id, step / {level}"
        )
    out.append(
        f"INSERT OR REPLACE INTO node_history (session, attempt, node_rank, level, bucket, n, first_step, last_step, "
        f"last_ts, {cols}) SELECT r.session, r.attempt, r.node_rank, h.level, h.bucket, sum(h.n), min(h.first_step), "
        f"max(h.last_step), max(h.last_ts), {node_aggs} FROM rank_history h JOIN ranks r USING (rank_id) "
        "WHERE r.node_rank IS NOT NULL GROUP BY r.session, r.attempt, r.node_rank, h.level, h.bucket"
    )
    # An evenly spaced sample stands in for the reservoir of old data, plus the latest point.
    out.append(
        f"INSERT OR REPLACE INTO reservoir (rank_id, slot, step, ts, step_ns, {phase_cols}) "
        f"SELECT rank_id, rn * {RESERVOIR_SIZE} / cnt, step, ts, step_ns, {phase_cols} FROM ("
        f"SELECT *, row_number() OVER (PARTITION BY rank_id ORDER BY step) - 1 AS rn, "
        f"count(*) OVER (PARTITION BY rank_id) AS cnt FROM steps WHERE step IS NOT NULL) "
        f"WHERE (rn * {RESERVOIR_SIZE}) / cnt != ((rn + 1) * {RESERVOIR_SIZE}) / cnt OR cnt <= {RESERVOIR_SIZE}"
    )
    out.append(
        f"INSERT OR REPLACE INTO reservoir (rank_id, slot, step, ts, step_ns, {phase_cols}) "
        f"SELECT rank_id, {LATEST_SLOT}, step, ts, step_ns, {phase_cols} FROM ("
        f"SELECT *, row_number() OVER (PARTITION BY rank_id ORDER BY step DESC, rowid DESC) AS rn FROM steps "
        "WHERE step IS NOT NULL) WHERE rn = 1"
    )
    out.append(
        "INSERT OR REPLACE INTO reservoir_state (rank_id, seen, next_take, w) "
        "SELECT rank_id, count(*), 0, 0.0 FROM steps WHERE step IS NOT NULL GROUP BY rank_id"
    )
    return out
