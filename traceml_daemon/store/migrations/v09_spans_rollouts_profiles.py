"""v9: span lanes, rollout sessions, profiles.

spans gain category, lane (thread or asyncio task), span_id and parent_id. The table
is rebuilt rather than altered: MIGRATIONS[0] makes today's wire tables, so a fresh
database already has the new columns and an ALTER would fail there. New tables: the
rollout session records and their phase executions (read per session of a run), and
the torch.profiler trace files ranks wrote."""

from __future__ import annotations

from traceml_daemon.store.schema import RANK_GROUP, telemetry_table_ddl

_V9_SPANS_OLD = "name, start_ns, dur_ns, step, args"


def statements() -> list[str]:
    return [
        telemetry_table_ddl("spans").replace("CREATE TABLE IF NOT EXISTS spans", "CREATE TABLE spans_v9"),
        f"INSERT INTO spans_v9 (rank_id, {_V9_SPANS_OLD}) SELECT rank_id, {_V9_SPANS_OLD} FROM spans",
        "DROP TABLE spans",
        "ALTER TABLE spans_v9 RENAME TO spans",
        f"CREATE INDEX spans_by_group ON spans (rank_id / {RANK_GROUP}, start_ns, rank_id)",
        telemetry_table_ddl("rollout_sessions"),
        f"CREATE INDEX IF NOT EXISTS rollout_sessions_by_group ON rollout_sessions "
        f"(rank_id / {RANK_GROUP}, session_id, rank_id)",
        telemetry_table_ddl("session_phases"),
        f"CREATE INDEX IF NOT EXISTS session_phases_by_group ON session_phases "
        f"(rank_id / {RANK_GROUP}, session_id, rank_id)",
        telemetry_table_ddl("profiles"),
        "CREATE INDEX IF NOT EXISTS profiles_by_rank ON profiles (rank_id, step)",
    ]
