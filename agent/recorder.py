"""Bounded row buffers between the training thread and the sender thread.

The training thread appends rows (a dict per row, cheap); the sender thread
drains them into columnar tables about once a second. The buffer has a byte
cap (estimated per row); past it the oldest rows of that table are dropped
and counted, never the training thread blocked. ``list.append`` and
``deque.popleft`` are atomic under the GIL, so the hot path takes no lock;
``drain`` swaps buffers under a lock only the sender holds.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from traceml_wire.tables import TABLES, TableBuilder

# Rough size of one row once packed (msgpack ints/floats are 1-9 bytes);
# used for the cap only, so it errs high.
_ROW_BYTES = {name: 12 * len(cols) + 16 for name, cols in TABLES.items()}


class Recorder:
    def __init__(self, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._rows: dict[str, deque[dict[str, Any]]] = {name: deque() for name in TABLES}
        self._bytes = 0
        self._lock = threading.Lock()
        self.rows_added = 0
        self.rows_dropped = 0
        self.dropped_by_table: dict[str, int] = {name: 0 for name in TABLES}

    def add(self, table: str, row: dict[str, Any]) -> None:
        """Append one row; never raises for a known table, never blocks."""
        size = _ROW_BYTES[table]
        rows = self._rows[table]
        while self._bytes + size > self.max_bytes and rows:
            rows.popleft()
            self._bytes -= size
            self.rows_dropped += 1
            self.dropped_by_table[table] += 1
        if self._bytes + size > self.max_bytes:
            self.rows_dropped += 1
            self.dropped_by_table[table] += 1
            return
        rows.append(row)
        self._bytes += size
        self.rows_added += 1

    def drain(self) -> dict[str, dict[str, list[Any]]]:
        """Take every buffered row as columnar tables (only the sender calls this)."""
        out: dict[str, dict[str, list[Any]]] = {}
        with self._lock:
            for name, rows in self._rows.items():
                if not rows:
                    continue
                builder = TableBuilder(name)
                taken = 0
                while rows:
                    try:
                        row = rows.popleft()
                    except IndexError:  # raced with an overflow drop
                        break
                    builder.append(row)
                    taken += 1
                self._bytes -= taken * _ROW_BYTES[name]
                out[name] = builder.take()
        return out

    def statistics(self) -> dict[str, int]:
        return {
            "buffered_bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "rows_added": self.rows_added,
            "rows_dropped": self.rows_dropped,
        }
