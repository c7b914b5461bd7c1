"""Run one function on an aiosqlite connection's own thread, with its sqlite3 connection.

aiosqlite has no public "run this function on your thread", and the writer needs
exactly that: a whole transaction in one call, not one awaited round trip (and GIL
hand-off) per statement. Its private ``Connection._execute`` and ``Connection._conn``
do it, so pyproject.toml pins aiosqlite to the versions they were tested with
(0.22.x), and ``require_private_api`` (run at ``StoreWriter.open``; the test
``tests/traceml_daemon/ingest/test_aiosqlite_api.py``) names the one that is gone.
The public API cannot do the same at the same cost: see docs/performance.md.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import aiosqlite

# The private members of ``aiosqlite.Connection`` used here, and what each is.
PRIVATE_API: dict[str, str] = {
    "_execute": "queue a function on the connection's thread and await its result",
    "_conn": "the connection's sqlite3.Connection",
}

P = ParamSpec("P")
T = TypeVar("T")


def missing_private_api(connection_type: type = aiosqlite.Connection) -> list[str]:
    """The members of ``PRIVATE_API`` that ``connection_type`` lacks."""
    return [name for name in PRIVATE_API if not hasattr(connection_type, name)]


def require_private_api(connection_type: type = aiosqlite.Connection) -> None:
    """Raise naming the private aiosqlite member that is missing, if one is."""
    missing = missing_private_api(connection_type)
    if missing:
        version = getattr(aiosqlite, "__version__", "?")
        named = "; ".join(f"aiosqlite.Connection.{name} ({PRIVATE_API[name]})" for name in missing)
        raise RuntimeError(
            f"aiosqlite {version} has no {named}, which traceml_daemon/store/db_thread.py calls: "
            "install the aiosqlite version pyproject.toml pins"
        )


def on_db_thread(
    db: aiosqlite.Connection,
    fn: Callable[Concatenate[sqlite3.Connection, P], T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> Coroutine[Any, Any, T]:
    """``fn(conn, *args, **kwargs)`` queued on ``db``'s thread (``conn``: its sqlite3
    connection), in the order of the calls: await it for the result. Queued when
    the returned coroutine first runs."""
    return db._execute(fn, db._conn, *args, **kwargs)
