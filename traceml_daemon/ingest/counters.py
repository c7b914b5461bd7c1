"""The daemon's own delivery counters, shared by connection handlers and the writer.

Only the event loop thread touches them (no locks). The writer stores them in
``delivery`` under source ``daemon`` inside every transaction, so the counts
that describe stored rows (``rows_stored``, ``duplicates_discarded``) survive
a kill -9 exactly; the others are at most one flush interval behind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from traceml_daemon.store.schema import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX

__all__ = ["AGENT_PREFIX", "DAEMON_SOURCE", "RELAY_PREFIX", "Counters"]


@dataclass
class Counters:
    frames_received: int = 0
    rows_stored: int = 0
    duplicates_discarded: int = 0
    oversize_frames: int = 0
    refused_peers: int = 0
    bad_bodies: int = 0
    # History partials that failed their checks; their batches' rows were stored and
    # folded by the daemon instead (traceml_wire/partials.py).
    partials_refused: int = 0
    protocol_errors: int = 0
    connections: int = 0
    # Batches set aside in ``quarantine`` (ingest/quarantine.py): acknowledged, not stored.
    batches_quarantined: int = 0
    # Of those, items whose seq jumped far past their sender's mark (traceml_wire/bounds.py).
    seq_jumps_refused: int = 0
    # Relay stats entries and agent drop counters not stored: bad, or beyond the cap.
    stats_refused: int = 0
    # Step and phase durations beyond the stored maximum, stored as NULL.
    durations_nulled: int = 0
    # Ranks rows built with no identity at all, and identity fields refused
    # (traceml_wire/identity.py): once per sender and identity stated, per daemon run.
    senders_without_identity: int = 0
    identity_fields_refused: int = 0
    # History folds that could not be written even alone and were let go (their raw
    # rows stay); never expected, counted so that it cannot go unseen.
    history_writes_dropped: int = 0
    # Raw rows deleted by retention (store/retention.py), by age, by size, or to make room on a full disk.
    rows_deleted_by_retention: int = 0
    # Agent batches, and the rows they held, acknowledged unstored because the disk was full
    # (ingest/disk_full.py).
    batches_dropped_disk_full: int = 0
    rows_dropped_disk_full: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def load(self, stored: dict[str, int]) -> None:
        """Start from the values a previous daemon stored (counts are cumulative per database)."""
        for f in fields(self):
            if f.name in stored:
                setattr(self, f.name, int(stored[f.name]))
