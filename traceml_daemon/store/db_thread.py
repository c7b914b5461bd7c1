"""Run one function on an aiosqlite connection's own thread, with its sqlite3 connection.

The writer needs a whole transaction in one call, not one awaited round trip (and
GIL hand-off) per statement, and aiosqlite has no public "run this function on
your thread": its private ``Connection._execute`` and ``Connection._conn`` do it.
Choice (b), pin, not the public API: with one awaited call per statement a
transaction could not be queued whole behind the running one, nor fold history on
this thread, and ingest throughput is a design target (docs/performance.md).
pyproject.toml pins aiosqlite to the versions these calls were tested with, and
``require_private_api`` (run by ``StoreWriter.open``; tested in
``tests/traceml_daemon/ingest/test_aiosqlite_api.py``) names a member that is gone.
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
