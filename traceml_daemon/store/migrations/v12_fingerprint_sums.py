"""v12: fingerprints' bit sums.

fingerprints gains param_sum: the parameter's bits summed as wrapping int32, the exact
equality witness replicas and runs are compared on (a float norm can round a one-ULP
change away). Rebuilt, not altered, as v10: a fresh database already has the column.
Old rows read NULL, not taken."""

from __future__ import annotations

from traceml_daemon.store.schema import RANK_GROUP

_V12_OLD = "step, model_id, idx, layer, param_norm, grad_norm, grad_nonfinite, shard"


def statements() -> list[str]:
    return [
        "CREATE TABLE fingerprints_v12 (rank_id INTEGER NOT NULL, step INTEGER, model_id INTEGER, idx INTEGER, "
        "layer TEXT, param_norm REAL, grad_norm REAL, grad_nonfinite INTEGER, shard INTEGER, param_sum INTEGER)",
        f"INSERT INTO fingerprints_v12 (rowid, rank_id, {_V12_OLD}) SELECT rowid, rank_id, {_V12_OLD} FROM fingerprints",
        "DROP TABLE fingerprints",
        "ALTER TABLE fingerprints_v12 RENAME TO fingerprints",
        f"CREATE INDEX fingerprints_by_group ON fingerprints (rank_id / {RANK_GROUP}, step, rank_id)",
    ]
