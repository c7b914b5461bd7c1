"""The writer runs whole transactions on aiosqlite's thread through its private
``Connection._execute`` and ``Connection._conn`` (``store/db_thread.py``), so
pyproject.toml pins the aiosqlite versions that was tested with. These tests fail,
naming the member, when the installed aiosqlite lacks one or runs calls otherwise."""

from __future__ import annotations

import asyncio
import importlib.metadata
import sqlite3
import threading
import tomllib
from pathlib import Path

import aiosqlite
import pytest
from packaging.requirements import Requirement

from traceml_daemon.store.db_thread import PRIVATE_API, missing_private_api, on_db_thread, require_private_api

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_installed_aiosqlite_has_the_private_members_the_writer_calls() -> None:
    require_private_api()  # raises naming each missing member


def test_installed_aiosqlite_is_a_version_the_pin_allows() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in deps if Requirement(d).name == "aiosqlite"]
    assert pin.specifier, "pyproject.toml must pin aiosqlite: the writer calls its private API"
    installed = importlib.metadata.version("aiosqlite")
    assert pin.specifier.contains(installed), f"aiosqlite {installed} is outside the tested pin {pin}"


@pytest.mark.parametrize("gone", sorted(PRIVATE_API))
def test_a_missing_private_member_is_named(gone: str) -> None:
    class Without:  # an aiosqlite.Connection of a release that dropped ``gone``
        pass

    for name in PRIVATE_API:
        if name != gone:
            setattr(Without, name, None)
    assert missing_private_api(Without) == [gone]
    with pytest.raises(RuntimeError, match=f"aiosqlite.Connection.{gone} "):
        require_private_api(Without)


def test_calls_run_on_the_connection_thread_in_the_order_they_were_queued(tmp_path: Path) -> None:
    """What the writer relies on: each call gets the connection's own sqlite3
    connection, on its thread (not the event loop's), and calls queued one behind
    another run in that order, the next after the previous one has returned."""
    ran: list[tuple[int, int]] = []

    def record(conn: sqlite3.Connection, n: int) -> int:
        assert isinstance(conn, sqlite3.Connection)
        ran.append((n, threading.get_ident()))
        conn.execute("CREATE TABLE IF NOT EXISTS t (n)")
        conn.execute("INSERT INTO t VALUES (?)", (n,))
        return n

    async def go() -> list[int]:
        async with aiosqlite.connect(tmp_path / "t.db", isolation_level=None) as db:
            calls = [asyncio.ensure_future(on_db_thread(db, record, n)) for n in range(20)]
            results = await asyncio.gather(*calls)
            async with db.execute("SELECT n FROM t ORDER BY rowid") as cur:
                stored = [row[0] async for row in cur]
            assert stored == list(range(20))
            return results

    assert asyncio.run(go()) == list(range(20))
    assert [n for n, _ in ran] == list(range(20))
    threads = {ident for _, ident in ran}
    assert len(threads) == 1 and threads != {threading.get_ident()}
