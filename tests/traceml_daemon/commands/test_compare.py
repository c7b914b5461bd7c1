"""compare: pure deltas/divergence and the CLI on two small SQLite runs."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest

from traceml_daemon.analysis.diff import compare_runs, format_compare, ulp_distance
from traceml_daemon.analysis.model import RunData
from traceml_daemon.analysis.scalars import scalar_key, split_key
from traceml_daemon.commands.compare import load_run, main
from traceml_daemon.store.migrations import MIGRATIONS

MS = 1_000_000


def next_up(x: float, n: int = 1) -> float:
    (i,) = struct.unpack("<q", struct.pack("<d", x))
    return struct.unpack("<d", struct.pack("<q", i + n))[0]


def make_db(path: Path, backward_ms: float, losses: list[float], ranks: int = 2, session: str = "s1") -> Path:
    con = sqlite3.connect(path)
    for step in MIGRATIONS:
        for sql in step:
            con.execute(sql)
    # An older session that must be ignored: only the latest session/attempt counts.
    con.execute(
        "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, first_seen) VALUES (99, 'old', 'old', 0, 0, 1.0)"
    )
    con.execute("INSERT INTO steps (rank_id, step, step_ns) VALUES (99, 0, 1)")
    con.execute("INSERT INTO scalars (rank_id, step, name, value) VALUES (99, 0, 'loss', 123.0)")
    for r in range(ranks):
        con.execute(
            "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, local_rank, node_rank, hostname, "
            "parallelism, first_seen) VALUES (?, ?, ?, 0, ?, ?, 0, 'h', 'ddp', 100.0)",
            (r + 1, f"s{r}", session, r, r),
        )
        for step in range(40):
            phases = [5 * MS, 1 * MS, 30 * MS, int(backward_ms * MS), 10 * MS, 4 * MS]
            con.execute(
                "INSERT INTO steps (rank_id, step, ts, step_ns, dataloader_ns, h2d_ns, forward_ns, backward_ns, "
                "optimizer_ns, wait_ns, rss_bytes, model_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (r + 1, step, 100.0 + step, sum(phases), *phases, 2**30),
            )
        for step, loss in enumerate(losses):
            con.execute(
                "INSERT INTO scalars (rank_id, step, name, value) VALUES (?, ?, 'loss', ?)", (r + 1, step, loss)
            )
            con.execute(
                "INSERT INTO scalars (rank_id, step, name, value) VALUES (?, ?, 'train/lr', 0.1)", (r + 1, step)
            )
    con.commit()
    con.close()
    return path


LOSSES = [2.5 - 0.01 * i for i in range(20)]


def diverged(at: int, ulps: int) -> list[float]:
    out = list(LOSSES)
    out[at] = next_up(out[at], ulps)
    return out


def test_ulp_distance() -> None:
    assert ulp_distance(1.0, 1.0) == 0
    assert ulp_distance(0.0, -0.0) == 0
    assert ulp_distance(1.0, next_up(1.0, 3)) == 3
    assert ulp_distance(-1.0, next_up(-1.0, 2)) == 2
    assert ulp_distance(-5e-324, 5e-324) == 2
    assert ulp_distance(float("nan"), float("nan")) == 0
    assert ulp_distance(float("nan"), 1.0) > 2**62


def test_scalar_key_roundtrip() -> None:
    assert split_key(scalar_key("train/loss@x", 3)) == ("train/loss@x", 3)
    assert split_key("loss") == ("loss", None)


def test_load_run_latest_session(tmp_path: Path) -> None:
    run, scalars = load_run(str(make_db(tmp_path / "a.db", 50.0, LOSSES)))
    assert [r.global_rank for r in run.ranks] == [0, 1]
    assert run.parallelism == "ddp"
    assert len(run.ranks[0].steps) == 40 and run.ranks[0].phases_ns["backward"][0] == 50 * MS
    assert sorted(scalars) == ["loss@0", "loss@1", "train/lr@0", "train/lr@1"]
    assert scalars["loss@0"][0] == (0, 2.5)


def test_first_divergent_step_and_deltas(tmp_path: Path) -> None:
    a = load_run(str(make_db(tmp_path / "a.db", 50.0, LOSSES)))
    b = load_run(str(make_db(tmp_path / "b.db", 60.0, diverged(7, 5))))
    res = compare_runs(a[0], b[0], a[1], b[1], ulp=0)
    d = res["scalars"]["first_divergence"]
    assert (d["name"], d["rank"], d["first_divergent_step"]) == ("loss", 0, 7)
    assert d["a"] == LOSSES[7] and d["b"] == next_up(LOSSES[7], 5) and d["ulp_distance"] == 5
    assert res["scalars"]["identical"] is False
    rows = {r["metric"]: r for r in res["deltas"]}
    assert rows["backward"]["delta_ms"] == pytest.approx(10.0) and rows["backward"]["verdict"] == "REGRESSION"
    assert rows["step"]["delta_pct"] == pytest.approx(100 * 10 / 100, abs=0.01)
    assert rows["forward"]["verdict"] is None and rows["forward"]["delta_ms"] == 0
    back = compare_runs(b[0], a[0], b[1], a[1])
    assert {r["metric"]: r for r in back["deltas"]}["backward"]["verdict"] == "IMPROVEMENT"


def test_ulp_tolerance_respected(tmp_path: Path) -> None:
    a = load_run(str(make_db(tmp_path / "a.db", 50.0, LOSSES)))
    b = load_run(str(make_db(tmp_path / "b.db", 50.0, diverged(7, 5))))
    assert compare_runs(a[0], b[0], a[1], b[1], ulp=5)["scalars"]["identical"] is True
    assert compare_runs(a[0], b[0], a[1], b[1], ulp=4)["scalars"]["first_divergence"]["first_divergent_step"] == 7
    same = compare_runs(a[0], a[0], a[1], a[1])
    assert same["scalars"]["identical"] and same["scalars"]["steps_compared"] == 80
    assert all(r["verdict"] is None for r in same["deltas"])


def test_verdict_changes(tmp_path: Path) -> None:
    a = load_run(str(make_db(tmp_path / "a.db", 50.0, LOSSES)))
    b = load_run(str(make_db(tmp_path / "b.db", 50.0, LOSSES)))
    b[0].ranks[1].phases_ns["dataloader"] = [100 * MS] * 40
    b[0].ranks[1].step_ns = [200 * MS] * 40
    res = compare_runs(a[0], b[0], a[1], b[1])
    assert "INPUT_STRAGGLER" in res["verdicts"]["only_b"]
    assert "COMPUTE_BOUND" in res["verdicts"]["only_a"]


def _input_straggler(run: RunData, rank: int) -> RunData:
    r = next(r for r in run.ranks if r.global_rank == rank)
    r.phases_ns["dataloader"] = [100 * MS] * 40
    r.step_ns = [200 * MS] * 40
    return run


def test_straggler_moving_to_another_rank_is_reported(tmp_path: Path) -> None:
    pa, pb = make_db(tmp_path / "a.db", 50.0, LOSSES, ranks=4), make_db(tmp_path / "b.db", 50.0, LOSSES, ranks=4)
    (ra, sa), (rb, sb) = load_run(str(pa)), load_run(str(pb))
    res = compare_runs(_input_straggler(ra, 1), _input_straggler(rb, 3), sa, sb)
    v = res["verdicts"]
    # The same verdict name in both runs: by name alone nothing changed.
    assert "INPUT_STRAGGLER" not in v["only_a"] + v["only_b"]
    rank1, rank3 = {"global_rank": 1, "node_rank": 0}, {"global_rank": 3, "node_rank": 0}
    assert {"name": "INPUT_STRAGGLER", "scope": rank1} in v["scoped_only_a"]
    assert {"name": "INPUT_STRAGGLER", "scope": rank3} in v["scoped_only_b"]
    (moved,) = [m for m in v["moved"] if m["name"] == "INPUT_STRAGGLER"]
    assert moved["from"] == [rank1] and moved["to"] == [rank3]
    assert moved["a"] == [rank1] and moved["b"] == [rank3]
    assert "Verdict moved: INPUT_STRAGGLER rank 1 (node 0) -> rank 3 (node 0)" in format_compare(res)


def test_added_culprit_is_a_move_and_same_culprit_is_not(tmp_path: Path) -> None:
    pa, pb = make_db(tmp_path / "a.db", 50.0, LOSSES, ranks=4), make_db(tmp_path / "b.db", 50.0, LOSSES, ranks=4)

    def straggling(path: Path, *ranks: int) -> tuple[RunData, dict]:
        run, scalars = load_run(str(path))
        for r in ranks:
            _input_straggler(run, r)
        return run, scalars

    (ra, sa), (rb, sb) = straggling(pa, 1), straggling(pb, 1)
    same = compare_runs(ra, rb, sa, sb)["verdicts"]
    assert same["moved"] == [] and same["scoped_only_a"] == [] and same["scoped_only_b"] == []
    rc, sc = straggling(pb, 1, 3)
    wider = compare_runs(ra, rc, sa, sc)["verdicts"]
    (moved,) = [m for m in wider["moved"] if m["name"] == "INPUT_STRAGGLER"]
    assert moved["from"] == [] and moved["to"] == [{"global_rank": 3, "node_rank": 0}]
    assert moved["b"] == [{"global_rank": 1, "node_rank": 0}, {"global_rank": 3, "node_rank": 0}]


def test_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pa = make_db(tmp_path / "a.db", 50.0, LOSSES)
    pb = make_db(tmp_path / "b.db", 60.0, diverged(3, 1))
    assert main([str(pa), str(pb)]) == 4  # diverged
    text = capsys.readouterr().out
    assert "first divergence at step 3: loss (rank 0)" in text and "REGRESSION" in text
    assert main([str(pa), str(pb), "--json", "--ulp", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["scalars"]["identical"] is True and res["scalars"]["ulp"] == 1
    assert res["a"]["path"] == str(pa)


def test_cli_errors_name_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pa = make_db(tmp_path / "a.db", 50.0, LOSSES)
    missing = tmp_path / "nope.db"
    assert main([str(pa), str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    assert main([str(junk), str(pa)]) == 2
    assert f"{junk}: not a traceml database" in capsys.readouterr().err
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    assert main([str(other), str(pa)]) == 2
    assert f"{other}: not a traceml database" in capsys.readouterr().err


def test_through_the_traceml_daemon_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from traceml_daemon.commands.cli import main as cli_main

    pa = make_db(tmp_path / "a.db", 50.0, LOSSES)
    assert cli_main(["compare", str(pa), str(pa), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scalars"]["identical"] is True
    assert cli_main(["compare", str(pa), str(tmp_path / "missing.db")]) == 2
    assert "missing.db: no such file" in capsys.readouterr().err
