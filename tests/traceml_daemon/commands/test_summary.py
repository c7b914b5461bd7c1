"""`traceml-daemon summary` over a database written by the real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.procs import DaemonProcess, base_env
from tests.traceml_daemon.wire_client import WireClient, agent_sender, steps_body
from traceml_wire import messages


def summary(db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "traceml_daemon", "summary", "--db", str(db), *extra],
        capture_output=True, text=True, env=base_env(), timeout=120,
    )


def write_run(db: Path, hostname: str = "host{node}") -> None:
    """2 nodes x 2 ranks through two relays; rank 3 is slower."""
    with DaemonProcess(db) as daemon:
        for node in (0, 1):
            with WireClient(daemon.port) as c:
                assert c.handshake(f"relay/s1/n{node}/9-r")["t"] == messages.ACCEPT
                items, peers = [], {}
                for local in (0, 1):
                    rank = node * 2 + local
                    sender = agent_sender("s1", rank, node=node)
                    step_ns = 40_000_000 if rank == 3 else 20_000_000
                    items.append([sender, 1, steps_body(0, 20, step_ns=step_ns)])
                    peers[sender] = {"global_rank": rank, "local_rank": local, "node_rank": node,
                                     "world_size": 4, "nnodes": 2, "hostname": hostname.format(node=node), "parallelism": "ddp"}
                node_id = {"node_rank": node, "hostname": hostname.format(node=node)}
                c.rbatch(1, items, peers, node=node_id, stats={"dropped_batches": 0})
                assert c.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0


def test_summary_json_has_the_documented_keys(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    write_run(db)
    done = summary(db, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for key in ("schema_version", "session", "started_at", "ended_at", "topology", "ranks", "nodes", "verdicts", "delivery"):
        assert key in out
    assert out["session"] == "s1"
    assert out["topology"] == {"nnodes": 2, "world_size": 4, "parallelism": "ddp"}
    assert [r["global_rank"] for r in out["ranks"]] == [0, 1, 2, 3]
    r3 = out["ranks"][3]
    assert (r3["node_rank"], r3["local_rank"], r3["hostname"], r3["steps"]) == (1, 1, "host1", 20)
    assert (r3["first_step"], r3["last_step"], r3["step_ms_median"]) == (0, 19, 40.0)
    assert set(r3["phases_ms_median"]) == {"dataloader", "h2d", "forward", "backward", "optimizer", "wait"}
    assert r3["memory"]["rss_bytes"] == 1 << 30 and r3["memory"]["peak_bytes"] is None
    assert [(n["node_rank"], n["ranks"], n["worst_rank"]["global_rank"]) for n in out["nodes"]] == [
        (0, [0, 1], 0), (1, [2, 3], 3)]
    assert isinstance(out["verdicts"], list)
    delivery = out["delivery"]
    assert delivery["rows_stored"] == 80 and delivery["duplicates_discarded"] == 0
    assert delivery["rows_dropped_reported"] == 0 and delivery["frames_received"] >= 4
    # The files next to the db hold the same summary.
    assert json.loads((tmp_path / "final_summary.json").read_text())["ranks"] == out["ranks"]
    assert "host1" in (tmp_path / "final_summary.txt").read_text()


def test_summary_text_is_a_readable_table(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    write_run(db)
    done = summary(db)
    assert done.returncode == 0, done.stderr
    assert "session s1" in done.stdout
    assert "dataloader" in done.stdout and "Delivery" in done.stdout


def test_summary_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    done = summary(missing)
    assert done.returncode == 2 and str(missing) in done.stderr
    bogus = tmp_path / "bogus.db"
    bogus.write_text("not sqlite at all " * 100)
    done = summary(bogus)
    assert done.returncode == 2 and str(bogus) in done.stderr and "not a traceml database" in done.stderr


def test_long_run_is_summarised_from_a_bounded_sample_with_exact_counts(tmp_path: Path, monkeypatch) -> None:
    import sqlite3

    from tests.support.synth_db import SynthSpec, build
    from traceml_daemon.commands import summary as summary_module
    from traceml_daemon.store import reader

    db = tmp_path / "long.db"
    build(str(db), SynthSpec(nnodes=1, ranks_per_node=2, steps=3000, straggler=1, with_detail=False))
    full = summary_module.build_summary(str(db))
    # A budget of 1,000 rows for 2 ranks: 500 each at most (SAMPLE_MIN_STEPS lowered to
    # let the small run stand for a long one), the newest 100 dense.
    monkeypatch.setattr(reader, "SAMPLE_BUDGET_ROWS", 1_000)
    monkeypatch.setattr(reader, "SAMPLE_MIN_STEPS", 100)
    monkeypatch.setattr(reader, "SAMPLE_TAIL_STEPS", 100)
    sampled = summary_module.build_summary(str(db))

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    for before, after in zip(full["ranks"], sampled["ranks"], strict=True):
        rank_id = con.execute("SELECT rank_id FROM ranks WHERE global_rank=?", (after["global_rank"],)).fetchone()[0]
        total, first, last = con.execute(
            "SELECT count(*), min(step), max(step) FROM steps WHERE rank_id=?", (rank_id,)
        ).fetchone()
        # Counts and bounds stay exact; only what the medians read is a sample.
        assert (after["steps"], after["first_step"], after["last_step"]) == (total, first, last) == (
            before["steps"], before["first_step"], before["last_step"])
        assert before["steps_analysed"] == total
        assert 100 < after["steps_analysed"] <= 500 + 100
        # Uniform thinning keeps the medians (the synthetic steps are stationary).
        assert abs(after["step_ms_median"] - before["step_ms_median"]) <= 0.05 * before["step_ms_median"]
    # The straggler is still named from the sample.
    assert {(v["name"], v["scope"].get("global_rank")) for v in sampled["verdicts"]} >= {
        (v["name"], v["scope"].get("global_rank")) for v in full["verdicts"] if v["severity"] != "info"}
    text = summary_module.render_text(sampled)
    assert "uniform sample" in text and "newest 100 all included" in text


def test_sample_of_strided_steps_is_not_aliased_away(tmp_path: Path) -> None:
    import sqlite3

    from tests.support.synth_db import SynthSpec, build
    from traceml_daemon.store import reader

    db = tmp_path / "strided.db"
    build(str(db), SynthSpec(nnodes=1, ranks_per_node=1, steps=10, straggler=None, with_detail=False))
    rw = sqlite3.connect(db)
    # One row per optimizer step of 2 accumulated micro-steps: odd step numbers only.
    rw.execute("DELETE FROM steps")
    rw.executemany(
        "INSERT INTO steps (rank_id, step, ts, step_ns, forward_ns) VALUES (1, ?, ?, 20000000, 5000000)",
        [(2 * i + 1, 1.0 + i) for i in range(3000)],
    )
    rw.commit()
    rw.close()
    con = reader.open_readonly(str(db))
    rank = reader.load_ranks(con, reader.latest_run(con))[0]
    data = reader.load_rank_data(con, rank, cap=600)
    assert data.steps_stored == 3000
    assert 300 < len(data.steps) <= 700  # spread over the run, not only the dense tail
    assert data.steps[0] == 1 and data.steps[-1] == 5999
    assert data.steps == sorted(set(data.steps))


def test_sample_of_contiguous_steps_is_every_kth_and_the_dense_tail(tmp_path: Path) -> None:
    from tests.support.synth_db import SynthSpec, build
    from traceml_daemon.store import reader

    db = tmp_path / "contiguous.db"
    build(str(db), SynthSpec(nnodes=1, ranks_per_node=10, steps=3000, straggler=None, with_detail=False))
    con = reader.open_readonly(str(db))
    ranks = reader.load_ranks(con, reader.latest_run(con))
    counts = reader._step_counts_many(con, [r.rank_id for r in ranks])
    plain = con.execute("SELECT rank_id, count(*), min(step), max(step) FROM steps GROUP BY rank_id")
    assert counts == {rank_id: reader.StepCounts(*rest) for rank_id, *rest in plain}
    assert reader._step_counts(con, ranks[3].rank_id) == counts[ranks[3].rank_id]
    for rank in ranks:
        data = reader.load_rank_data(con, rank, cap=600, counts=counts[rank.rank_id])
        # tail = min(SAMPLE_TAIL_STEPS, cap // 2) = 300; every = ceil(3000 / (600 - 300)) = 10.
        assert data.steps == sorted({*range(0, 3000, 10), *range(2700, 3000)})
        assert data.steps_stored == 3000 and data.global_rank == rank.global_rank


def test_summary_text_escapes_control_characters_from_peers(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    write_run(db, hostname="evil\x1b[2J\x07{node}")
    done = summary(db)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "evil\\x1b[2J\\x070" in done.stdout  # shown, escaped
    as_json = json.loads(summary(db, "--json").stdout)
    assert as_json["ranks"][0]["hostname"] == "evil\x1b[2J\x070"  # JSON keeps the exact value
