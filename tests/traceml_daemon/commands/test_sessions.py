"""`traceml-daemon sessions`: the JSONL records, the text summary, and errors that say what to do."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from traceml_daemon.commands import cli
from traceml_daemon.store.migrate import migrate


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "s.db"
    migrate(str(path))
    con = sqlite3.connect(path)
    for rank_id, grank, session in ((1, 0, "old"), (2, 0, "new"), (3, 1, "new")):
        con.execute("INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, first_seen, last_seen) "
                    "VALUES (?, ?, ?, 0, ?, ?, ?)", (rank_id, f"{session}/r{grank}", session, grank, rank_id, 10.0))
    rows = [(2, 7, 1, "pending", None, 100.0, None, None), (2, 7, 1, "accepted", None, 100.0, 101.5, 0),
            (3, 8, 1, "rejected", "stale_weight", 100.2, 100.9, 1), (3, 8, 2, "pending", None, 100.4, None, None),
            (1, 1, 1, "accepted", None, 50.0, 51.0, 0)]
    con.executemany("INSERT INTO rollout_sessions (rank_id, task_id, session_id, status, reason, submit_ts, "
                    "finalized_ts, open_phases) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.executemany("INSERT INTO session_phases (rank_id, session_id, phase, start_ts, end_ts, start_payload, "
                    "end_payload) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(2, 1, "generate", 100.0, 101.0, '{"prompt": 3}', None), (2, 1, "reward", 101.0, 101.4, None, None),
                     (3, 1, "generate", 100.2, None, None, None)])
    con.commit()
    con.close()
    return path


def test_jsonl_has_the_areal_layout_of_the_latest_run(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    assert cli.main(["sessions", "--db", str(db), "--jsonl", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["rank"], r["session_id"], r["status"]) for r in recs] == [(0, 1, "accepted"), (1, 1, "rejected"),
                                                                          (1, 2, "pending")]
    first = recs[0]
    assert first["total_s"] == pytest.approx(1.5) and first["generate_s"] == pytest.approx(1.0)
    assert first["reward_s"] == pytest.approx(0.4)
    assert first["phases"]["generate"] == [{"start_ts": 100.0, "end_ts": 101.0, "start_payload": {"prompt": 3}}]
    rejected = recs[1]
    assert rejected["reason"] == "stale_weight" and rejected["open_phases"] == 1
    assert rejected["phases"]["generate"][0]["end_ts"] is None and rejected["generate_s"] == 0
    assert recs[2]["total_s"] is None and recs[2]["finalized_ts"] is None


def test_session_option_and_text_summary(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sessions", "--db", str(db), "--session", "old", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["session"] == "old" and s["sessions"] == 1 and s["statuses"] == {"accepted": 1}
    assert cli.main(["sessions", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert "sessions: 3 (2 finalized, 1 pending)" in text and "rejected: stale_weight (1)" in text
    assert "oldest pending" in text and "session 2" in text


def test_errors_name_the_problem(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sessions", "--db", str(db), "--session", "nope"]) == 2
    assert "no session 'nope'" in capsys.readouterr().err
    assert cli.main(["sessions", "--db", str(tmp_path / "missing.db")]) == 2
    assert "missing.db" in capsys.readouterr().err
    assert cli.main(["sessions", "--db", str(db), "--jsonl", str(tmp_path / "no" / "dir" / "x.jsonl")]) == 2
    assert "pick a writable path" in capsys.readouterr().err


def test_policy_file_changes_the_thresholds(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    strict = tmp_path / "p.toml"
    strict.write_text("[rollouts]\nmin_sessions = 1\nreject_frac = 0.1\n")
    assert cli.main(["sessions", "--db", str(db), "--json", "--policy", str(strict)]) == 0
    assert "ROLLOUT_REJECTIONS_HIGH" in {v["name"] for v in json.loads(capsys.readouterr().out)["verdicts"]}
    assert cli.main(["sessions", "--db", str(db), "--json"]) == 0
    default = {v["name"] for v in json.loads(capsys.readouterr().out)["verdicts"]}
    assert "ROLLOUT_REJECTIONS_HIGH" not in default  # two finalized sessions: too few by default
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollouts]\nno_such_key = 1\n")
    assert cli.main(["sessions", "--db", str(db), "--policy", str(bad)]) == 2
    assert "no_such_key" in capsys.readouterr().err
