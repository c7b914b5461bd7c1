"""v13: which steps carry device timing.

steps gain device_timed (agent/device_sampling.py): 1 timed on the device, 0 a GPU step
timed on the host only, NULL on CPU and in older rows. Rebuilt, not altered, as v10."""

from __future__ import annotations

from traceml_daemon.store.migrations.v10_fsdp2 import V10_TABLES
from traceml_daemon.store.schema import GROUPED_INDEXES, RANK_GROUP

# The columns of steps from v10 to v13, in the table's order.
V13_STEPS = V10_TABLES["steps"][0] + ", " + V10_TABLES["steps"][1]


def statements() -> list[str]:
    kept = "rowid, rank_id, " + ", ".join(col.split()[0] for col in V13_STEPS.split(", "))
    return [
        f"CREATE TABLE steps_v13 (rank_id INTEGER NOT NULL, {V13_STEPS}, device_timed INTEGER)",
        f"INSERT INTO steps_v13 ({kept}) SELECT {kept} FROM steps",
        "DROP TABLE steps",  # drops its indexes with it
        "ALTER TABLE steps_v13 RENAME TO steps",
        f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, {GROUPED_INDEXES['steps']}, rank_id)",
    ]
