"""Multi-row statements: many rows in one ``head VALUES (...), (...) tail`` statement.

Python's sqlite3 releases the GIL around every ``sqlite3_step``, and the writer
thread may wait a whole switch interval to get it back while the event loop is
busy; one step per statement of many rows, not one per row, keeps those
hand-offs few (figures: docs/performance.md). Statement shapes are few (full
chunks, then power-of-two pieces), so each is compiled once and cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import chain, islice
from typing import Any

from traceml_wire.tables import Column

# (head, tail, width) of a statement: ``head VALUES (?, ...), ... tail``, ``width``
# parameters a row.
SqlParts = tuple[str, str, int]
Statement = tuple[str, Sequence[Any]]  # one multi-row statement and its flat parameters

# sqlite >= 3.32 allows 32766 bound parameters per statement.
MAX_PARAMS = 32_000
ROWS_PER_STATEMENT = 2048

_chain = chain.from_iterable


@lru_cache(maxsize=512)
def values_sql(head: str, tail: str, width: int, nrows: int) -> str:
    one = f"({', '.join('?' * width)})"
    return f"{head} VALUES {', '.join([one] * nrows)} {tail}".rstrip()


def one_row_sql(parts: SqlParts) -> str:
    """The single-row form of ``parts`` (for ``executemany``)."""
    head, tail, width = parts
    return f"{head} VALUES ({', '.join('?' * width)}) {tail}".rstrip()


def statement_sizes(width: int, nrows: int) -> Iterator[int]:
    """Rows per statement: full chunks of one shape, then the rest in power-of-two
    pieces, so few shapes exist (each is compiled once, then cached)."""
    per = 1
    while per * 2 <= min(ROWS_PER_STATEMENT, MAX_PARAMS // width):
        per *= 2
    at = 0
    size = per
    while at < nrows:
        while size > nrows - at:
            size //= 2
        yield size
        at += size


def multi_row(parts: SqlParts, flat: Sequence[Any], nrows: int) -> list[Statement]:
    """Statements inserting ``nrows`` rows whose parameters are ``flat`` (row-major),
    each statement one sqlite3_step (see ``statement_sizes``)."""
    head, tail, width = parts
    out: list[Statement] = []
    at = 0
    for size in statement_sizes(width, nrows):
        out.append((values_sql(head, tail, width, size), flat[at * width : (at + size) * width]))
        at += size
    return out


def multi_row_stream(parts: SqlParts, rows: Iterable[Iterable[Any]], nrows: int) -> Iterator[Statement]:
    """Like ``multi_row``, each statement's parameters built only when it is reached
    (``rows``: ``nrows`` iterables of a row's values, flattened in C): a history write
    holds about a million parameters, and building them all first doubled its peak memory."""
    head, tail, width = parts
    it = iter(rows)
    for size in statement_sizes(width, nrows):
        yield values_sql(head, tail, width, size), list(_chain(islice(it, size)))


def multi_row_tuples(parts: SqlParts, rows: Iterable[tuple[Any, ...]]) -> list[Statement]:
    flat = list(chain.from_iterable(rows))
    return multi_row(parts, flat, len(flat) // parts[2])


def chunk_statements(parts: SqlParts, chunks: list[tuple[int, list[Column]]]) -> list[Statement]:
    """Statements inserting every row of ``chunks`` ((rank_id, columns) per batch, in
    order): each row is the rank id, then its columns' values.

    Each statement's parameters are one list, filled by strided slice assignment (one
    C-level pass per column and batch piece): every value is copied once, where zipping
    rows into tuples, flattening and slicing them copied it three times."""
    head, tail, width = parts
    counts = [len(cols[0]) for _, cols in chunks]
    out: list[Statement] = []
    at_chunk = 0  # the batch the next row comes from, and where in it
    at_row = 0
    for size in statement_sizes(width, sum(counts)):
        params: list[Any] = [None] * (size * width)
        filled = 0
        while filled < size:
            rank_id, cols = chunks[at_chunk]
            take = min(size - filled, counts[at_chunk] - at_row)
            start = filled * width
            stop = start + take * width
            params[start:stop:width] = [rank_id] * take
            whole = at_row == 0 and take == counts[at_chunk]
            for offset, col in enumerate(cols, 1):
                params[start + offset : stop : width] = col if whole else col[at_row : at_row + take]
            filled += take
            at_row += take
            if at_row == counts[at_chunk]:
                at_chunk += 1
                at_row = 0
        out.append((values_sql(head, tail, width, size), params))
    return out
