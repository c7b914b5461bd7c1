"""v5: a reservoir size per rank.

A rank's sample holds RESERVOIR_SIZE points, or fewer in a big job (see
IngestPolicy.reservoir_size_for), so the reservoir table stays bounded whatever
the number of ranks. Each rank keeps the size it started with: Algorithm L's state
(seen, next_take, w) is only meaningful for one size. Ranks sampled before v5 keep
the size they had."""

from __future__ import annotations

from traceml_daemon.store.schema import RESERVOIR_SIZE


def statements() -> list[str]:
    return [f"ALTER TABLE reservoir_state ADD COLUMN size INTEGER NOT NULL DEFAULT {RESERVOIR_SIZE}"]
