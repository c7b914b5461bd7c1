"""v10: FSDP2 collective wait and mesh.

steps gain the FSDP2 collective time measured inside forward and backward, its part on
HSDP's replicate dimension and the device memory after forward; models the mesh's
shard and replicate sizes (schema.LATER_COLUMNS). Rebuilt, not altered: MIGRATIONS[0]
makes today's wire tables, so a fresh database already has the columns and an ALTER
would fail there. Rows keep their rowids (readers tail steps by rowid); old rows read
NULL, not measured. The tables are written out, so this step stays what it was."""

from __future__ import annotations

from traceml_daemon.store.schema import GROUPED_INDEXES, RANK_GROUP

# Table -> (its columns before v10, the columns v10 appends).
V10_TABLES = {
    "steps": ("step INTEGER, ts REAL, step_ns INTEGER, dataloader_ns INTEGER, h2d_ns INTEGER, forward_ns INTEGER, "
              "backward_ns INTEGER, optimizer_ns INTEGER, wait_ns INTEGER, comm_ns INTEGER, peak_bytes INTEGER, "
              "reserved_bytes INTEGER, rss_bytes INTEGER, model_id INTEGER",
              "fwd_comm_ns INTEGER, bwd_comm_ns INTEGER, replicate_comm_ns INTEGER, post_forward_bytes INTEGER"),
    "models": ("model_id INTEGER, name TEXT, parallelism TEXT, n_modules INTEGER, param_bytes INTEGER, "
               "local_shard_bytes INTEGER, estimated_full_bytes INTEGER",
               "shard_degree INTEGER, replicate_degree INTEGER"),
}


def statements() -> list[str]:
    out: list[str] = []
    for table, (old, new) in V10_TABLES.items():
        kept = "rowid, rank_id, " + ", ".join(col.split()[0] for col in old.split(", "))
        out += [
            f"CREATE TABLE {table}_v10 (rank_id INTEGER NOT NULL, {old}, {new})",
            f"INSERT INTO {table}_v10 ({kept}) SELECT {kept} FROM {table}",
            f"DROP TABLE {table}",  # drops its index with it
            f"ALTER TABLE {table}_v10 RENAME TO {table}",
        ]
    return out + [
        f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, {GROUPED_INDEXES['steps']}, rank_id)",
        "CREATE INDEX models_by_rank ON models (rank_id, model_id)",
    ]
