"""One hostile rbatch never stops the real daemon: it is answered, what of it cannot
be stored is set aside in ``quarantine`` (or refused) with its reason and counted in
``delivery``, the good rbatch after it is stored exactly, and the daemon restarted
on the same database opens and serves. Each case sends through the real wire as a
relay would."""

from __future__ import annotations

import sqlite3
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.procs import DaemonProcess, free_port, summary
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, count_steps, daemon_counters, steps_body
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import NONFINITE_SCALAR
from traceml_wire import messages
from traceml_wire.body import encode_body
from traceml_wire.bounds import INT64_MAX, MAX_DURATION_NS, MAX_SENDERS_PER_RBATCH

A0, A1 = agent_sender("s1", 0), agent_sender("s1", 1)
PEERS = {A0: {"global_rank": 0, "node_rank": 0}, A1: {"global_rank": 1, "node_rank": 0}}


def ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def rows(db: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = ro(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


@contextmanager
def relay_to(daemon: DaemonProcess, sender: str = RELAY) -> Iterator[WireClient]:
    with WireClient(daemon.port) as client:
        reply = client.handshake(sender)
        assert reply is not None and reply["t"] == messages.ACCEPT, reply
        yield client


def send(client: WireClient, seq: int, items: list[list[Any]], peers: dict[str, dict[str, Any]] | None = None,
         stats: dict[str, Any] | None = None) -> None:
    """One rbatch, and its ack."""
    client.rbatch(seq, items, peers if peers is not None else PEERS, stats=stats)
    assert client.recv() == {"t": messages.ACK, "seq": seq}


def alive(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()


def stop(daemon: DaemonProcess) -> None:
    assert daemon.stop() == 0, daemon.log()
    assert "Traceback" not in daemon.log(), daemon.log()


def restart_serves(db: Path) -> None:
    """A daemon started on ``db`` opens it and stores a new relay's new rank."""
    before = count_steps(db)
    newcomer = agent_sender("s1", 7)
    with DaemonProcess(db) as daemon, relay_to(daemon, "relay/s1/n3/2-r") as client:
        send(client, 1, [[newcomer, 1, steps_body(0, 5)]], {newcomer: {"global_rank": 7}})
        stop(daemon)
    assert count_steps(db) == before + 5


def quarantined(db: Path) -> list[tuple[Any, ...]]:
    return rows(db, "SELECT relay, sender, seq, reason FROM quarantine ORDER BY id")


def test_relay_stats_beyond_int64_are_refused_and_the_rest_stored(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 1, steps_body(0, 5)]], stats={"dropped_batches": 2**64 - 1, "spooled_batches": 3})
        send(client, 2, [[A0, 2, steps_body(5, 5)]], stats={"dropped_batches": 1})
        alive(daemon)
        stop(daemon)
    assert count_steps(db) == 10
    relay = dict(rows(db, "SELECT counter, value FROM delivery WHERE source=?", "relay:" + RELAY))
    assert relay == {"spooled_batches": 3, "dropped_batches": 1}
    assert daemon_counters(db)["stats_refused"] == 1
    restart_serves(db)


def test_an_item_seq_beyond_int64_is_set_aside_counted_and_reported(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    metrics_port = free_port()
    with DaemonProcess(db, args=["--metrics-port", str(metrics_port)]) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 2**64 - 1, steps_body(100, 5)], [A1, 1, steps_body(0, 5)]])
        send(client, 2, [[A0, 1, steps_body(0, 5)]])
        alive(daemon)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
            exposition = response.read().decode()
        stop(daemon)
    assert "batches_quarantined" in exposition
    assert count_steps(db) == 10
    assert quarantined(db) == [(RELAY, A0, str(2**64 - 1), "seq outside 1..2**63-1")]
    assert daemon_counters(db)["batches_quarantined"] == 1
    report = summary(db)
    assert report is not None and report["delivery"]["batches_quarantined"] == 1
    restart_serves(db)


def test_long_steps_saturate_history_and_longer_ones_are_not_measured(tmp_path: Path) -> None:
    """Two steps of 2**62 ns (beyond the stored maximum: NULL, counted), and 1024 steps of
    the maximum, whose level-1024 bucket sums past int64 (pinned at its bound)."""
    db = tmp_path / "run.db"
    n = 1024
    # On steps_body's clock: serve's default retention would delete rows decades older than the newest.
    long = encode_body({"steps": {"step": list(range(n, 2 * n)), "ts": [1_700_000_000.0] * n,
                                  "step_ns": [MAX_DURATION_NS] * n}})
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 1, steps_body(0, 2, step_ns=2**62)]])
        send(client, 2, [[A0, 2, long]])
        send(client, 3, [[A1, 1, steps_body(0, 5)]])
        alive(daemon)
        stop(daemon)  # writes history
    assert count_steps(db) == 2 + n + 5
    assert rows(db, "SELECT step, step_ns FROM steps WHERE step < 2 AND rank_id = 1") == [(0, None), (1, None)]
    assert daemon_counters(db)["durations_nulled"] == 2
    assert rows(db, "SELECT step_n, step_sum, typeof(step_sum) FROM rank_history WHERE rank_id = 1 AND level = 1024 "
                    "AND bucket = 1") == [(n, INT64_MAX, "integer")]
    restart_serves(db)


def test_a_forged_seq_for_another_sender_is_refused_and_that_sender_goes_on(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 1, steps_body(0, 5)]])
        send(client, 2, [[A0, 2**63 - 1, steps_body(100, 5)]])  # claims every later seq of A0
        send(client, 3, [[A0, 2, steps_body(5, 5)]])
        alive(daemon)
        stop(daemon)
    assert rows(db, "SELECT step FROM steps ORDER BY step") == [(s,) for s in range(10)]
    assert quarantined(db) == [
        (RELAY, A0, str(2**63 - 1), f"seq {2**63 - 1} jumps more than {2**20} past the sender's last seq 1")
    ]
    assert (daemon_counters(db)["seq_jumps_refused"], daemon_counters(db)["batches_quarantined"]) == (1, 1)
    assert rows(db, "SELECT last_seq FROM ranks WHERE sender=?", A0) == [(2,)]
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:  # the mark survives, not the forgery
        send(client, 1, [[A0, 3, steps_body(10, 5)]])
        stop(daemon)
    assert count_steps(db) == 15
    restart_serves(db)


def test_senders_beyond_their_bounds_are_set_aside(tmp_path: Path) -> None:
    """1500 distinct senders in one rbatch (1024 admitted) and one of 60,000 characters,
    within what the frame limits let through (traceml_wire/framing.py)."""
    db = tmp_path / "run.db"
    empty = encode_body({})
    many = [[f"s1/a0/n0/r{i}/1-x", 1, empty] for i in range(1500)]
    long = "h" * 60_000
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[long, 1, steps_body(0, 5)], *many], peers={})
        send(client, 2, [[A0, 1, steps_body(0, 5)]])
        alive(daemon)
        stop(daemon)
    assert count_steps(db) == 5
    assert rows(db, "SELECT count(*) FROM ranks") == [(MAX_SENDERS_PER_RBATCH + 1,)]
    reasons = rows(db, "SELECT reason, count(*), max(length(sender)) FROM quarantine GROUP BY reason ORDER BY 2")
    assert reasons == [
        ("sender of 60000 characters (at most 256)", 1, 300 + len("... (60000 characters)")),
        (f"more than {MAX_SENDERS_PER_RBATCH} senders in one rbatch", 1500 - MAX_SENDERS_PER_RBATCH, len(many[-1][0])),
    ]
    assert daemon_counters(db)["batches_quarantined"] == 1500 - MAX_SENDERS_PER_RBATCH + 1
    restart_serves(db)


def test_stats_keys_beyond_the_cap_are_dropped_and_counted(tmp_path: Path) -> None:
    """4000 counters: as many as the frame limits let through (traceml_wire/framing.py)."""
    db = tmp_path / "run.db"
    stats = {f"counter_{i}": i for i in range(4000)}
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 1, steps_body(0, 5)]], stats=stats)
        send(client, 2, [[A0, 2, steps_body(5, 5)]])
        alive(daemon)
        stop(daemon)
    assert count_steps(db) == 10
    assert rows(db, "SELECT count(*) FROM delivery WHERE source=?", "relay:" + RELAY) == [(64,)]
    assert daemon_counters(db)["stats_refused"] == 4000 - 64
    restart_serves(db)


def test_a_nan_loss_is_stored_as_nan_and_found_by_the_nonfinite_index(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    values = [0.5, float("nan"), float("inf"), float("-inf")]
    body = encode_body({"scalars": {"step": [0, 1, 2, 3], "name": ["loss"] * 4, "value": values}})
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 1, body]])
        send(client, 2, [[A0, 2, steps_body(0, 5)]])
        alive(daemon)
        stop(daemon)
    assert rows(db, "SELECT step, value FROM scalars ORDER BY step") == [
        (0, 0.5), (1, "NaN"), (2, float("inf")), (3, float("-inf"))
    ]
    found = rows(db, f"SELECT step, value FROM scalars WHERE {NONFINITE_SCALAR} ORDER BY step")
    assert [(step, float(value)) for step, value in found][1:] == [(2, float("inf")), (3, float("-inf"))]
    assert found[0][0] == 1 and float(found[0][1]) != float(found[0][1])  # NaN reads back as NaN
    assert count_steps(db) == 5
    restart_serves(db)


def _database_with_overflowed_history(db: Path) -> None:
    """A v6 database as the old daemon left it after the overflow: two steps of 2**62 ns
    in one bucket committed but not folded (the history write crashed), and a bucket
    whose sum an overflowing SQL ``+`` had turned into a REAL."""
    conn = sqlite3.connect(db, isolation_level=None)
    for statements in MIGRATIONS[:6]:
        for statement in statements:
            conn.execute(statement)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '6')")
    conn.execute("INSERT INTO meta VALUES ('history_steps_rowid', '0')")
    conn.execute("INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, node_rank, last_seq) "
                 "VALUES (1, ?, 's1', 0, 0, 0, 1)", (A0,))
    # On steps_body's clock: serve's default retention would delete rows decades older than the newest.
    conn.executemany("INSERT INTO steps (rank_id, step, ts, step_ns) VALUES (1, ?, 1700000000.0, ?)",
                     [(0, 2**62), (1, 2**62)])
    conn.execute("INSERT INTO rank_history (rank_id, level, bucket, n, first_step, last_step, step_n, step_sum) "
                 "VALUES (1, 1024, 0, 2, 0, 1, 2, 1.8446744073709552e19)")
    conn.close()


def test_a_daemon_opens_and_serves_a_database_with_overflowed_history(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    _database_with_overflowed_history(db)
    with DaemonProcess(db) as daemon, relay_to(daemon) as client:
        send(client, 1, [[A0, 2, steps_body(2, 5)]])
        alive(daemon)
        stop(daemon)
    assert count_steps(db) == 7
    assert rows(db, "SELECT step_n, step_sum, typeof(step_sum) FROM rank_history WHERE level = 1024") == [
        (2 + 2 + 5, INT64_MAX, "integer")
    ]
    restart_serves(db)
