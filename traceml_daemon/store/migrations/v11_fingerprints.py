"""v11: numerics fingerprints.

Per parameter tensor every N steps (agent/fingerprint.py): norms and the gradient's
non-finite count. Read per run (verdicts, compare) by step. Written out rather than
from the wire declaration, so this step stays what it was. IF NOT EXISTS: a fresh
database already has it from MIGRATIONS[0]."""

from __future__ import annotations

from traceml_daemon.store.schema import RANK_GROUP


def statements() -> list[str]:
    return [
        "CREATE TABLE IF NOT EXISTS fingerprints (rank_id INTEGER NOT NULL, step INTEGER, model_id INTEGER, "
        "idx INTEGER, layer TEXT, param_norm REAL, grad_norm REAL, grad_nonfinite INTEGER, shard INTEGER)",
        f"CREATE INDEX IF NOT EXISTS fingerprints_by_group ON fingerprints (rank_id / {RANK_GROUP}, step, rank_id)",
    ]
