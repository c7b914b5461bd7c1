"""The daemon's request directory (`traceml-daemon profile --db`): hostile files are refused
with a result that says why and counted, names that are not ours are skipped and counted,
and the directory is the daemon's alone (0700)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from traceml_daemon.net.control_requests import (
    MAX_REQUEST_BYTES,
    ControlRequests,
    control_dir,
    parse_request,
)
from traceml_daemon.net.routes import ControlRoutes

GOOD = {"op": "profile", "rank": 1, "steps": 3, "session": "s1"}


@pytest.mark.parametrize("change", [
    {"op": "shell"}, {"rank": -1}, {"rank": True}, {"rank": 2**40}, {"rank": "1"}, {"steps": 0}, {"steps": 101},
    {"steps": 2.5}, {"session": ""}, {"session": 7}, {"session": "x" * 300},
])
def test_hostile_fields_are_refused(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        parse_request("0123abcd", json.dumps({**GOOD, **change}).encode())


def test_a_good_request_parses() -> None:
    req = parse_request("0123abcd", json.dumps(GOOD).encode())
    assert (req.rank, req.steps, req.session) == (1, 3, "s1")
    assert parse_request("0123abcd", json.dumps({**GOOD, "session": None}).encode()).session is None


def test_the_directory_refuses_and_counts_what_is_not_a_request(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    requests = ControlRequests(str(db), ControlRoutes())
    requests.prepare()
    directory = control_dir(db)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (directory / "NOT-AN-ID.request.json").write_text(json.dumps(GOOD))
    (directory / "aaaaaaaa.request.json").write_bytes(b"x" * (MAX_REQUEST_BYTES + 10))
    (directory / "bbbbbbbb.request.json").write_bytes(b"\xff\xfe not json")
    (directory / "cccccccc.request.json").write_text(json.dumps(GOOD))  # valid, but no rank connected
    (directory / "unrelated.txt").write_text("left alone")
    assert requests.poll() == 3
    assert requests.refused == 4 and requests.sent == 0
    answers = {p.name.split(".")[0]: json.loads(p.read_text()) for p in directory.glob("*.result.json")}
    assert set(answers) == {"aaaaaaaa", "bbbbbbbb", "cccccccc"}
    assert all(a["status"] == "refused" for a in answers.values())
    assert "over" in answers["aaaaaaaa"]["message"]
    assert "not JSON" in answers["bbbbbbbb"]["message"]
    assert "rank 1 of session s1 is not connected" in answers["cccccccc"]["message"]
    assert not list(directory.glob("*.request.json"))
    assert (directory / "unrelated.txt").exists()
    requests.remove()
    assert not directory.exists()
