"""Downsampled history kept by the writer: exact buckets, a reservoir that
always holds the latest point, and overview reads bounded by the width."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path

import pytest

from tests.traceml_daemon.history_support import batch, raw_buckets, ro, stored_buckets
from traceml_daemon.ingest.pipeline import StoreWriter
from traceml_daemon.store import history
from traceml_daemon.store.policy import IngestPolicy
from traceml_daemon.store.schema import HISTORY_LEVELS, LATEST_SLOT, RESERVOIR_SIZE
from traceml_wire.bounds import saturate


async def _write(db: Path, batches: list) -> None:
    writer = StoreWriter(str(db))
    await writer.open()
    for b in batches:
        assert await writer.write([b])
    await writer.close()


def test_buckets_equal_raw_min_max_mean_at_every_level(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    # Uneven batch sizes so buckets fill across transactions and daemon restarts.
    batches, step, seq = [], 0, 0
    for n in (5, 64, 100, 3, 1000, 777, 2100):
        seq += 1
        batches.append(batch(seq, [0, 1, 2], step, n))
        step += n
    asyncio.run(_write(db, batches[:4]))
    asyncio.run(_write(db, batches[4:]))  # a restart in the middle of buckets
    conn = ro(db)
    for level in HISTORY_LEVELS:
        raw, stored = raw_buckets(conn, level), stored_buckets(conn, level)
        assert stored == raw, level  # n, count, min, max, sum: the mean is sum / count
    node = conn.execute("SELECT sum(n), min(step_min), max(step_max) FROM node_history WHERE level=64 AND node_rank=0")
    assert node.fetchone() == conn.execute(
        "SELECT count(*), min(step_ns), max(step_ns) FROM steps JOIN ranks USING (rank_id) WHERE node_rank=0"
    ).fetchone()


def test_reservoir_is_bounded_uniformish_and_keeps_the_latest_point(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    batches = [batch(i + 1, [0], i * 500, 500) for i in range(20)]  # 10,000 steps
    asyncio.run(_write(db, batches))
    conn = ro(db)
    slots = conn.execute("SELECT slot, step FROM reservoir WHERE rank_id=1 ORDER BY slot").fetchall()
    assert len(slots) == RESERVOIR_SIZE + 1
    assert dict(slots)[LATEST_SLOT] == 9_999
    sample = sorted(s for slot, s in slots if slot != LATEST_SLOT)
    assert len(set(sample)) == RESERVOIR_SIZE
    # A uniform sample over 10,000 steps reaches both ends, not only the first 256.
    assert sample[0] < 2_000 and sample[-1] > 8_000
    assert sum(1 for s in sample if s >= 5_000) > RESERVOIR_SIZE // 4
    # Every sampled point is a real row with its real values.
    for step, step_ns in conn.execute("SELECT step, step_ns FROM reservoir WHERE rank_id=1 LIMIT 20").fetchall():
        assert conn.execute("SELECT step_ns FROM steps WHERE rank_id=1 AND step=?", (step,)).fetchone()[0] == step_ns


def test_a_big_job_samples_fewer_points_per_rank_and_keeps_that_size_across_restarts(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    policy = IngestPolicy()
    assert policy.reservoir_size_for(None) == policy.reservoir_size_for(8) == RESERVOIR_SIZE
    assert policy.reservoir_size_for(2048) == 128
    assert policy.reservoir_size_for(4096) == policy.reservoir_size_for(100_000) == 64

    async def run(first: int, world_size: int) -> None:
        writer = StoreWriter(str(db), history_interval=0.0)
        await writer.open()
        for i in range(5):
            assert await writer.write([batch(first // 500 + i + 1, [0, 1], first + i * 500, 500, world_size=world_size)])
        await writer.close()

    asyncio.run(run(0, 4096))
    # A restarted daemon (here told another world size) samples on at the size each rank started with.
    asyncio.run(run(2500, 8))
    conn = ro(db)
    for rank_id in (1, 2):
        sample = [s for (s,) in conn.execute("SELECT step FROM reservoir WHERE rank_id=? AND slot>=0", (rank_id,))]
        assert len(sample) == len(set(sample)) == 64
        assert min(sample) < 1_000 and max(sample) > 4_000  # uniform over all 5,000 steps
        assert conn.execute("SELECT size, seen FROM reservoir_state WHERE rank_id=?", (rank_id,)).fetchone() == (64, 5000)
        latest = conn.execute("SELECT step FROM reservoir WHERE rank_id=? AND slot=?", (rank_id, LATEST_SLOT)).fetchone()
        assert latest == (4_999,)


def test_overview_reads_at_most_width_points_per_series(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    batches = [batch(i + 1, [0, 1, 2, 3], i * 2000, 2000) for i in range(10)]  # 20,000 steps x 4 ranks
    asyncio.run(_write(db, batches))
    conn = ro(db)
    ov = history.overview(conn, "s1", 0, width=50)
    assert ov.span.first_step == 0 and ov.span.last_step == 19_999 and ov.span.steps == 80_000
    assert ov.level == 1024 and 0 < len(ov.series) <= 50
    assert sum(p.n for p in ov.series) == 80_000
    assert [n.node_rank for n in ov.nodes] == [0, 1] and ov.nodes[0].ranks == [0, 1]
    assert all(r.last_step == 19_999 and r.step_ms_median is not None for r in ov.ranks)
    series = history.rank_series(conn, "s1", 0, width=10)
    assert set(series) == {0, 1, 2, 3} and all(len(s) <= 10 for s in series.values())
    raw_max = conn.execute("SELECT max(step_ns) FROM steps").fetchone()[0] / 1e6
    assert max(p.max_ms["step"] or 0 for s in series.values() for p in s) == raw_max
    mean = conn.execute("SELECT avg(step_ns) FROM steps").fetchone()[0] / 1e6
    got = sum((p.mean_ms["step"] or 0) * p.n for p in ov.series) / 80_000
    assert abs(got - mean) < 1e-6 * mean


def test_choose_level_picks_the_finest_that_fits() -> None:
    assert history.choose_level(0, 999, 200) == (64, 1)
    assert history.choose_level(0, 999_999, 1000) == (1024, 1)
    level, group = history.choose_level(0, 999_999, 20)
    assert level == 16384 and 62 / group <= 20


def test_history_lost_in_a_crash_is_caught_up_from_raw_rows_on_open(tmp_path: Path) -> None:
    db = tmp_path / "c.db"

    async def crash_after(batches: list) -> None:
        # History is written at most once a second: with a long interval nothing
        # after the first transaction is written before the "crash" (no close()).
        writer = StoreWriter(str(db), history_interval=3600.0)
        await writer.open()
        for b in batches:
            assert await writer.write([b])
        assert writer._db is not None
        await writer._db.close()

    batches = [batch(i + 1, [0, 1, 2], i * 300, 300) for i in range(6)]
    asyncio.run(crash_after(batches[:3]))
    asyncio.run(crash_after(batches[3:]))
    conn = ro(db)
    assert conn.execute("SELECT count(*) FROM rank_history").fetchone()[0] < len(raw_buckets(conn, 64))
    # What the catch-up must continue: the saved sample, offered each rank's points past
    # its saved count, in commit order, by a sampler loaded from the saved state.
    sample = "SELECT rank_id, slot, step FROM reservoir ORDER BY 1, 2"
    expected = {(r, slot): step for r, slot, step in conn.execute(sample)}
    saved = conn.execute("SELECT rank_id, seen, next_take, w, size FROM reservoir_state").fetchall()
    sampler, update = history.Reservoir(), history.ReservoirUpdate()
    sampler.load(saved)
    for rank_id, seen, *_ in saved:
        points = conn.execute(
            f"SELECT {', '.join(history.HISTORY_COLUMNS)} FROM steps WHERE rank_id=? ORDER BY rowid", (rank_id,)
        ).fetchall()
        assert 0 < seen < len(points)
        sampler.offer_columns(rank_id, [list(c) for c in zip(*points[seen:], strict=True)], update)
    expected.update({key: row[2] for key, row in update.rows.items()})
    conn.close()
    asyncio.run(_write(db, []))  # open catches up, close writes
    conn = ro(db)
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level), level
    latest = dict(conn.execute("SELECT rank_id, step FROM reservoir WHERE slot=?", (LATEST_SLOT,)).fetchall())
    assert latest == {1: 1_799, 2: 1_799, 3: 1_799}
    assert {(r, slot): step for r, slot, step in conn.execute(sample)} == expected
    assert conn.execute("SELECT count(*) FROM reservoir").fetchone()[0] == 3 * (RESERVOIR_SIZE + 1)


def test_a_history_write_dirties_pages_by_level_not_by_rank(tmp_path: Path) -> None:
    """Every rank's current buckets are written together; keyed (level, bucket,
    rank) they share pages. Keyed rank first, each rank's rows sat on a page of
    its own and one write dirtied a page per rank and level."""
    db = tmp_path / "w.db"
    ranks = list(range(128))

    def wal_frames() -> int:
        wal = Path(f"{db}-wal")
        return max(0, (wal.stat().st_size - 32) // (4096 + 24)) if wal.exists() else 0

    def checkpoint() -> None:
        conn = sqlite3.connect(db)
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            assert busy == 0
        finally:
            conn.close()

    async def go() -> int:
        writer = StoreWriter(str(db), history_interval=3600.0)
        await writer.open()
        # ~1300 steps per rank: 21 level-64 buckets each, more than a page per rank.
        for i in range(13):
            assert await writer.write([batch(i + 1, ranks, i * 100, 100)])
        await writer._flush_history_now()
        assert await writer.write([batch(14, ranks, 1300, 1)])  # raw rows only: history is not due
        checkpoint()
        assert wal_frames() == 0
        await writer._flush_history_now()  # the one write measured: 128 ranks x 3 levels + reservoir
        frames = wal_frames()
        await writer.close()
        return frames

    frames = asyncio.run(go())
    conn = ro(db)
    assert conn.execute("SELECT count(*) FROM rank_history WHERE level=64").fetchone()[0] == 128 * 21
    assert conn.execute("SELECT count(DISTINCT step) FROM reservoir WHERE slot=?", (LATEST_SLOT,)).fetchone() == (1,)
    conn.close()
    # 128 ranks x 3 levels of ~250-byte rows and 128 latest points fill ~30 pages; a
    # page per rank would be >= 128 for the finest level alone.
    assert 0 < frames < len(ranks) // 2, frames


def test_history_interval_stretches_with_ranks_up_to_its_max() -> None:
    policy = IngestPolicy()
    assert policy.history_interval_for(0) == policy.history_interval == 1.0
    assert policy.history_interval_for(1024) == 1.0
    assert policy.history_interval_for(2048) == 2.0
    assert policy.history_interval_for(4096) == policy.history_interval_max == 4.0
    assert policy.history_interval_for(1_000_000) == 4.0
    # A longer base interval (tests: "only when forced") is never shortened.
    assert IngestPolicy(history_interval=3600.0).history_interval_for(4096) == 3600.0


def test_history_backlog_bound_grows_with_ranks() -> None:
    policy = IngestPolicy(history_backlog_rows=65_536, history_backlog_rows_per_rank=64)
    assert policy.history_backlog_rows_for(8) == 65_536  # the floor
    assert policy.history_backlog_rows_for(4096) == 64 * 4096  # 4096 ranks x 10 steps/s: 6.4 s of rows


def _reference_stats(cols: dict[str, list], rows: list[int]) -> history.Stats:
    """Stats of ``rows`` computed naively, value by value; a sum beyond int64 is stored
    at its bound (SQLite holds nothing wider)."""
    steps = [cols["step"][i] for i in rows]
    ts = [cols["ts"][i] for i in rows if cols["ts"][i] is not None]
    out: history.Stats = [len(steps), min(steps), max(steps), max(ts) if ts else None]
    for name in history.HISTORY_COLUMNS[2:]:
        values = [cols[name][i] for i in rows if cols[name][i] is not None]
        out += [len(values), min(values), max(values), saturate(sum(values))] if values else [0, None, None, 0]
    return out


def _expected_deltas(by_rank: dict[int, dict[str, list]]) -> dict[tuple[int, int, int], history.Stats]:
    expected = {}
    for rank_id, cols in by_rank.items():
        for level in HISTORY_LEVELS:
            buckets: dict[int, list[int]] = {}
            for i, step in enumerate(cols["step"]):
                if step is not None:
                    buckets.setdefault(step // level, []).append(i)
            for bucket, rows in buckets.items():
                expected[(rank_id, level, bucket)] = _reference_stats(cols, rows)
    return expected


def test_bucket_deltas_equal_a_naive_pass_in_any_order_with_gaps_and_nulls() -> None:
    rng = random.Random(3)
    by_rank = {}
    for rank_id, steps in {
        1: list(range(1000, 1100)),  # in order, across a level-1024 boundary
        2: rng.sample(range(16_000, 16_800), 300),  # out of order, across a level-16384 boundary
        3: [5, 7, None, 6],  # a step of None is left out of every figure
        4: [42],
        5: list(range(64, 128)),  # exactly one fine bucket
        6: list(range(16_300, 19_633)),  # a fast loop's flush: 3333 steps, dozens of buckets
    }.items():
        n = len(steps)
        cols = {"step": steps, "ts": [None if rng.random() < 0.2 else rng.random() for _ in range(n)]}
        for name in history.HISTORY_COLUMNS[2:]:
            cols[name] = [None if rng.random() < 0.1 else rng.randint(0, 10**9) for _ in range(n)]
        cols["wait_ns"] = [None] * n  # never measured
        by_rank[rank_id] = cols
    expected = _expected_deltas(by_rank)
    assert history.bucket_deltas(by_rank) == expected
    node_of = {1: ("s", 0, 0), 2: ("s", 0, 0), 3: ("s", 0, 1), 4: ("s", 0, 1), 5: None, 6: ("s", 0, 1)}
    nodes = history.node_deltas(expected, node_of.get)
    merged: dict[tuple, history.Stats] = {}
    for (rank_id, level, bucket), stats in expected.items():
        node = node_of[rank_id]
        if node is not None:
            key = (*node, level, bucket)
            if key in merged:
                history.merge_into(merged[key], stats)
            else:
                merged[key] = list(stats)
    assert nodes == merged


def test_long_runs_fold_exactly_whatever_the_column_holds() -> None:
    """Bucket sums past int64 (saturated), bools, floats sent in an int column, Nones
    and reals mixed with ints: every figure equals the naive pass's."""
    rng = random.Random(11)
    n = 1000
    steps = list(range(100, 100 + n))
    big = 2**62
    columns = {
        "step": steps,
        "ts": [rng.choice([rng.random(), rng.randint(0, 10**6)]) for _ in range(n)],  # REAL takes ints too
        "step_ns": [rng.randint(-(10**12), 10**12) for _ in range(n)],
        "dataloader_ns": [rng.choice([True, False]) for _ in range(n)],  # bools are the ints they are
        "h2d_ns": [None] * n,
        "forward_ns": [big + rng.randint(0, 10**6) for _ in range(n)],  # a bucket's sum leaves int64
        "backward_ns": [rng.randint(0, 10**9) + 0.5 for _ in range(n)],
        "optimizer_ns": [None if i % 97 == 0 else i for i in range(n)],
        "wait_ns": [0] * n,
    }
    by_rank = {9: columns, 10: {**columns, "ts": [float(t) for t in columns["ts"]]}}
    expected = _expected_deltas(by_rank)
    got = history.bucket_deltas(by_rank)
    assert got == expected
    assert all((a is None) == (b is None) for key in expected for a, b in zip(got[key], expected[key], strict=True))


def test_reservoir_includes_every_position_and_fills_every_slot_alike() -> None:
    """Uniform: over many ranks (independent streams), each tenth of a run's points is in
    the final samples as often as any other, and replacements land on every slot alike."""
    k, total, ranks = 64, 4096, 400
    columns = [list(range(total)) for _ in history.HISTORY_COLUMNS]
    sampler, update = history.Reservoir(size=k), history.ReservoirUpdate()
    for rank_id in range(ranks):
        for start in range(0, total, 512):
            sampler.offer_columns(rank_id, [c[start : start + 512] for c in columns], update)
    kept = [row[2] for (_, slot), row in update.rows.items() if slot != LATEST_SLOT]
    assert len(kept) == k * ranks
    per_tenth = [0] * 10
    for step in kept:
        per_tenth[step * 10 // total] += 1
    expected = k * ranks / 10  # 2,560 each, standard deviation ~48
    assert all(abs(n - expected) < 0.08 * expected for n in per_tenth), per_tenth
    # Where replacements go: every slot alike, for a sample size that is not a power of two.
    for size in (64, 100):
        per_slot = [0] * size
        stream = history.seeded_stream(3, 0)
        for _ in range(200_000):
            per_slot[history.Reservoir._draws(stream)[2] % size] += 1
        mean = 200_000 / size  # standard deviation ~1-2% of it
        assert min(per_slot) > 0.9 * mean and max(per_slot) < 1.1 * mean, (size, min(per_slot), max(per_slot))


def test_reservoir_sample_is_the_reference_algorithm_l() -> None:
    """``offer_columns`` inlines ``_draws`` and ``_gap``: for any chunking of the points,
    the rows and state it leaves equal the reference loop's, one point at a time, which
    seeds a rank's stream where each offer that draws starts."""
    k, rank_id, total = 16, 7, 3000
    cols = {name: list(range(j * 10**6, j * 10**6 + total)) for j, name in enumerate(history.HISTORY_COLUMNS)}
    columns = history.history_columns(cols)

    def reference(chunk: int) -> tuple[dict[tuple[int, int], tuple], int, float]:
        rows: dict[tuple[int, int], tuple] = {}
        w, take = 0.0, 0
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            if end > k and (w == 0.0 or take < end):
                stream = history.seeded_stream(rank_id, take)
            for i in range(start, end):
                if i < k:
                    rows[(rank_id, i)] = (rank_id, i, *(c[i] for c in columns))
                    continue
                if w == 0.0:
                    u1, u2, _ = history.Reservoir._draws(stream)
                    w = u1 ** (1.0 / k)
                    take = k - 1 + history.Reservoir._gap(w, u2)
                if i == take:
                    u1, u2, h = history.Reservoir._draws(stream)
                    rows[(rank_id, h % k)] = (rank_id, h % k, *(c[i] for c in columns))
                    w *= u1 ** (1.0 / k)
                    take += history.Reservoir._gap(w, u2)
        rows[(rank_id, LATEST_SLOT)] = (rank_id, LATEST_SLOT, *(c[-1] for c in columns))
        return rows, take, w

    for chunk in (total, 1, 7, 500):
        rows, take, w = reference(chunk)
        sampler, update = history.Reservoir(size=k), history.ReservoirUpdate()
        for start in range(0, total, chunk):
            sampler.offer_columns(rank_id, [c[start : start + chunk] for c in columns], update)
        assert update.rows == rows, chunk
        state = sampler.states[rank_id]
        assert (state.seen, state.next_take, state.w) == (total, take, w), chunk
        assert len(rows) == k + 1, chunk


def test_reservoir_replays_its_draws_after_a_rollback_or_a_reload() -> None:
    """A stream starts from the persisted state: a rolled-back offer retried, or the
    same points offered to a sampler loaded from the saved state, give the same sample
    as the offer that was never interrupted."""
    k, rank_id, total = 16, 3, 4000
    columns = [list(range(total)) for _ in history.HISTORY_COLUMNS]
    first, rest = [c[:1000] for c in columns], [c[1000:] for c in columns]

    def saved_after_first() -> tuple[history.Reservoir, list[tuple[int, int, int, float, int]]]:
        sampler, update = history.Reservoir(size=k), history.ReservoirUpdate()
        sampler.offer_columns(rank_id, first, update)
        return sampler, history.reservoir_rows(update)[1]

    # Reference: the rest offered to a sampler loaded from the saved state.
    _, saved = saved_after_first()
    loaded, expected = history.Reservoir(size=k), history.ReservoirUpdate()
    loaded.load(saved)
    loaded.offer_columns(rank_id, rest, expected)
    # The same, after a failed transaction took the rest and was rolled back.
    sampler, _ = saved_after_first()
    sampler.load(saved)  # what the writer's state is once the first transaction committed
    failed = history.ReservoirUpdate()
    sampler.offer_columns(rank_id, [c[:1500] for c in rest], failed)
    sampler.rollback(failed)
    retried = history.ReservoirUpdate()
    sampler.offer_columns(rank_id, rest, retried)
    assert retried.rows == expected.rows
    assert sampler.states[rank_id] == loaded.states[rank_id]
    # And a different seed position gives a different sample (the stream is not constant).
    other = history.Reservoir(size=k)
    other.load([(rank_id + 1, *saved[0][1:])])
    moved = history.ReservoirUpdate()
    other.offer_columns(rank_id + 1, rest, moved)
    assert [row[2:] for row in moved.rows.values()] != [row[2:] for row in expected.rows.values()]


def test_sql_merge_saturates_where_sqlites_own_addition_turns_real() -> None:
    """What SQLite does: an integer ``a + b`` that overflows becomes a REAL (which an
    INTEGER column then keeps), and sum() raises. The merge's addition never overflows,
    lands on a bound instead, and pins a REAL an older daemon stored to its bound."""
    from traceml_daemon.store.history_sql import saturating_add

    conn = sqlite3.connect(":memory:")
    top, bottom = 2**63 - 1, -(2**63)
    assert conn.execute("SELECT ?1 + 1, typeof(?1 + 1)", (top,)).fetchone() == (float(2**63), "real")
    with pytest.raises(sqlite3.OperationalError, match="integer overflow"):
        conn.execute("SELECT sum(x) FROM (SELECT ?1 AS x UNION ALL SELECT 1)", (top,)).fetchone()
    expr = saturating_add("?1", "?2")
    cases = [(top, 1, top), (top, top, top), (top - 5, 3, top - 2), (bottom, -1, bottom), (bottom, bottom, bottom),
             (bottom + 5, -3, bottom + 2), (5, -7, -2), (top, -1, top - 1), (bottom, 1, bottom + 1),
             (1.8e19, 0, top), (1.8e19, -3, top), (-1.8e19, 4, bottom), (-1.8e19, -4, bottom)]
    for have, add, expected in cases:
        assert conn.execute(f"SELECT {expr}, typeof({expr})", (have, add)).fetchone() == (expected, "integer"), (
            have, add)
