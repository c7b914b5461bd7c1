"""Downsampled step history: maintained as steps arrive, read for overviews.

Raw steps grow with the run and may be deleted by retention, so views of a
whole run never read them. Instead the writer folds every committed step into:

* ``rank_history`` / ``node_history``: per rank and per node, for each level in
  ``HISTORY_LEVELS``, the count, min, max and sum of ``step_ns`` and of every
  phase, merged exactly however the steps are split (``history_buckets``);
* ``reservoir``: per rank a uniform sample of raw points plus the newest point,
  so medians of a whole run and "where is it now" cost a few hundred rows per
  rank (``reservoir``).

This module is the one name for all of it; the work is done in:

* ``store/history_buckets.py``: the bucket arithmetic (pure);
* ``store/reservoir.py``: the sample (pure, deterministic);
* ``store/history_sql.py``: the tables' columns and merging upserts;
* ``store/history_read.py``: series, medians and the overview, read back.

Writing side (pure, used by the writer's history feed and by ``bench/history.py``):

    deltas = bucket_deltas(steps_by_rank)            # {(rank_id, level, bucket): Stats}
    nodes = node_deltas(deltas, node_of)             # {(session, attempt, node, level, bucket): Stats}
    sampler.offer(rank_id, cols, plan)               # reservoir rows to upsert
    conn.executemany(RANK_UPSERT, history_rows(deltas))  # merge in SQL

Reading side: ``overview(conn, session, attempt, width)`` and the ``*_series`` functions.
"""

from __future__ import annotations

from traceml_daemon.store.history_buckets import (
    HISTORY_COLUMNS,
    Columns,
    NodeKey,
    Stats,
    add_fine_deltas,
    add_rank_deltas,
    bucket_deltas,
    history_columns,
    merge_fine,
    merge_into,
    node_deltas,
)
from traceml_daemon.store.history_read import (
    NodeOverview,
    Overview,
    Point,
    RankOverview,
    RunSpan,
    choose_level,
    node_series,
    overview,
    rank_medians,
    rank_series,
    run_series,
    run_span,
)
from traceml_daemon.store.history_sql import (
    NODE_UPSERT,
    NODE_UPSERT_PARTS,
    RANK_UPSERT,
    RANK_UPSERT_PARTS,
    RESERVOIR_STATE_UPSERT,
    RESERVOIR_STATE_UPSERT_PARTS,
    RESERVOIR_UPSERT,
    RESERVOIR_UPSERT_PARTS,
    history_rows,
)
from traceml_daemon.store.reservoir import Reservoir, ReservoirState, ReservoirUpdate, reservoir_rows, seeded_stream
from traceml_daemon.store.statements import SqlParts

__all__ = [
    "HISTORY_COLUMNS",
    "NODE_UPSERT",
    "NODE_UPSERT_PARTS",
    "RANK_UPSERT",
    "RANK_UPSERT_PARTS",
    "RESERVOIR_STATE_UPSERT",
    "RESERVOIR_STATE_UPSERT_PARTS",
    "RESERVOIR_UPSERT",
    "RESERVOIR_UPSERT_PARTS",
    "Columns",
    "NodeKey",
    "NodeOverview",
    "Overview",
    "Point",
    "RankOverview",
    "Reservoir",
    "ReservoirState",
    "ReservoirUpdate",
    "RunSpan",
    "SqlParts",
    "Stats",
    "add_fine_deltas",
    "add_rank_deltas",
    "bucket_deltas",
    "choose_level",
    "history_columns",
    "history_rows",
    "merge_fine",
    "merge_into",
    "node_deltas",
    "node_series",
    "overview",
    "rank_medians",
    "rank_series",
    "reservoir_rows",
    "run_series",
    "run_span",
    "seeded_stream",
]
