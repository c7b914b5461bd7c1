"""v8: rank output.

Each rank's stdout and stderr lines (wire table "output"), read per rank in time
order (``traceml-daemon logs``, the step inspector), grouped like the other tables."""

from __future__ import annotations

from traceml_daemon.store.schema import RANK_GROUP, telemetry_table_ddl


def statements() -> list[str]:
    return [
        telemetry_table_ddl("output"),
        f"CREATE INDEX IF NOT EXISTS output_by_group ON output (rank_id / {RANK_GROUP}, ts, rank_id)",
    ]
