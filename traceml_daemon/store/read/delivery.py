"""Delivery counters: what the daemon, agents and relays counted, summed per kind of source.

The one definition of rows and batches lost that the summary, the TUI and
``/metrics`` report: which agent and relay counters are lost rows, which are
lost batches (a relay's ``dropped_bytes`` is neither).
"""

from __future__ import annotations

import sqlite3

from traceml_daemon.store.schema import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX
from traceml_wire.bounds import INT64_MAX

# Agent counters that are lost rows (each unit one row or one step row) and
# lost batches (each an unknown number of rows). Everything else an agent
# reports (errors, fallbacks) is informative, summed under ``agent_<name>``:
# ``device_steps_dropped`` / ``device_steps_fallback`` / ``device_steps_overflow``
# are steps whose device events timed out, were lost or were given up, and which
# were stored with their host timings; ``steps_dropped`` are CPU steps the
# tracer's bounded queue discarded (no row); ``sender_oversize_rows`` are rows
# too large for any batch.
AGENT_ROW_DROPS = ("recorder_rows", "steps_dropped", "scalars_dropped", "sender_oversize_rows")
AGENT_BATCH_DROPS = ("sender_batches",)
RELAY_BATCH_DROPS = ("dropped_batches",)
# The daemon's own: rows it acknowledged unstored because its disk was full (ingest/disk_full.py).
DAEMON_ROW_DROPS = ("rows_dropped_disk_full",)


def delivery_counters(conn: sqlite3.Connection) -> dict[str, int]:
    """Flat counters for the summary: the daemon's own; rows and batches that an
    agent or relay reported lost (rows also those the daemon's full disk could not
    hold); every other agent and relay counter summed under ``agent_<counter>`` /
    ``relay_<counter>``."""
    out: dict[str, int] = {
        "frames_received": 0,
        "rows_stored": 0,
        "rows_dropped_reported": 0,
        "batches_dropped_reported": 0,
        "duplicates_discarded": 0,
        "oversize_frames": 0,
        "refused_peers": 0,
    }
    # Summed per kind of source in SQL: with thousands of senders the table holds
    # tens of thousands of rows and the TUI reads this while a run is live.
    by_kind = conn.execute(
        "SELECT CASE WHEN source = ? THEN 'daemon' WHEN substr(source, 1, ?) = ? THEN 'agent' "
        "WHEN substr(source, 1, ?) = ? THEN 'relay' END AS kind, counter, total(value) "
        "FROM delivery GROUP BY kind, counter HAVING kind IS NOT NULL",
        (DAEMON_SOURCE, len(AGENT_PREFIX), AGENT_PREFIX, len(RELAY_PREFIX), RELAY_PREFIX),
    )
    for kind, counter, summed in by_kind:
        # total() is a float sum: peers' counters near int64 must not overflow the read.
        value = int(min(summed, INT64_MAX))
        if kind == "daemon":
            out[counter] = value
            if counter in DAEMON_ROW_DROPS:
                out["rows_dropped_reported"] += value
            continue
        if kind == "agent":
            if counter in AGENT_ROW_DROPS:
                out["rows_dropped_reported"] += value
            elif counter in AGENT_BATCH_DROPS:
                out["batches_dropped_reported"] += value
        elif counter in RELAY_BATCH_DROPS:
            out["batches_dropped_reported"] += value
        name = f"{kind}_{counter}"
        out[name] = out.get(name, 0) + value
    return out


def has_daemon_counters(conn: sqlite3.Connection) -> bool:
    """Whether the daemon stored its own counters yet (before that they are not measured, not zero)."""
    return conn.execute("SELECT 1 FROM delivery WHERE source=? LIMIT 1", (DAEMON_SOURCE,)).fetchone() is not None
