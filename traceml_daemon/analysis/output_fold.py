"""Rank output folded across ranks: identical lines once, with their ranks and count.

Pure: lines in, folded entries out. A Python traceback of one rank is one
entry (its lines joined), so the same exception on 64 ranks folds into one.
Entries come tracebacks first, then error lines, then warnings, then the rest,
each class by first appearance: what failed is on the first screen.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from traceml_daemon.analysis.stats import rank_ranges

TRACEBACK_HEAD = "Traceback (most recent call last):"
# Lines between two tracebacks of one chained exception.
_CHAIN = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_ERROR = re.compile(r"\b(error|exception|fatal|failed|failure|abort(ed)?|segmentation fault|core dumped)\b", re.I)
_WARNING = re.compile(r"warn(ing)?s?\b", re.I)  # UserWarning, FutureWarning too

# torch.distributed prefixes what a rank prints of an uncaught exception with "[rankN]: ":
# taken off, so the same line folds across ranks (the rank is in the entry's prefix).
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")

# Display order of the kinds.
KINDS = ("traceback", "error", "warning", "line")


@dataclass(frozen=True)
class OutputLine:
    global_rank: int
    ts: float
    stream: str
    seq: int
    line: str


@dataclass(frozen=True)
class Traceback:
    """One rank's traceback: its lines (head to the exception line) and when it began."""

    global_rank: int
    ts: float
    lines: tuple[str, ...]

    @property
    def exception(self) -> str:
        """The last line: ``ValueError: ...``."""
        return self.lines[-1] if self.lines else ""


@dataclass
class Folded:
    text: str  # the line, or a traceback's lines joined by newlines
    kind: str  # one of KINDS
    stream: str  # where it was first seen
    first_ts: float
    last_ts: float
    count: int = 0
    ranks: set[int] = field(default_factory=set)

    @property
    def ranks_text(self) -> str:
        return rank_ranges(self.ranks)

    def prefix(self) -> str:
        """``[ranks 0-63 x12]``: the ranks it came from and how often it was printed."""
        word = "rank" if len(self.ranks) == 1 else "ranks"
        return f"[{word} {self.ranks_text} x{self.count}]"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "text": self.text,
            "ranks": sorted(self.ranks),
            "ranks_text": self.ranks_text,
            "count": self.count,
            "stream": self.stream,
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
        }


def unprefixed(text: str) -> str:
    """``text`` without torch's ``[rankN]: `` prefix."""
    return _RANK_PREFIX.sub("", text, count=1) if text.startswith("[rank") else text


def line_kind(text: str) -> str:
    if _ERROR.search(text):
        return "error"
    if _WARNING.search(text):
        return "warning"
    return "line"


def split_tracebacks(lines: Sequence[OutputLine]) -> tuple[list[Traceback], list[OutputLine]]:
    """One rank's lines (in order) as its tracebacks and the lines outside them, torch's
    ``[rankN]: `` prefixes taken off."""
    lines = [_plain(x) for x in lines]
    tracebacks: list[Traceback] = []
    rest: list[OutputLine] = []
    i, n = 0, len(lines)
    while i < n:
        if lines[i].line.rstrip() != TRACEBACK_HEAD:
            rest.append(lines[i])
            i += 1
            continue
        start = i
        i = _traceback_end(lines, i)
        tracebacks.append(
            Traceback(lines[start].global_rank, lines[start].ts, tuple(x.line for x in lines[start:i]))
        )
    return tracebacks, rest


def _plain(x: OutputLine) -> OutputLine:
    text = unprefixed(x.line)
    return x if text is x.line else OutputLine(x.global_rank, x.ts, x.stream, x.seq, text)


def _traceback_end(lines: Sequence[OutputLine], i: int) -> int:
    """The index after the traceback starting at ``i``: through its exception line, and
    through the tracebacks chained after it."""
    n = len(lines)
    i += 1
    while i < n:
        text = lines[i].line
        if text[:1] in (" ", "\t") or text.rstrip() == TRACEBACK_HEAD:
            i += 1
            continue
        # The exception line ends it, unless a chained traceback follows.
        i += 1
        j = i
        while j < n and not lines[j].line.strip():
            j += 1
        if j < n and lines[j].line.strip() in _CHAIN:
            i = j + 1
            while i < n and not lines[i].line.strip():
                i += 1
            continue
        return i
    return i


def fold(lines: Iterable[OutputLine]) -> list[Folded]:
    """Identical lines (and identical tracebacks) across ranks, once each, in display order."""
    by_rank: dict[int, list[OutputLine]] = {}
    for line in lines:
        by_rank.setdefault(line.global_rank, []).append(line)
    entries: dict[tuple[str, str], Folded] = {}

    def add(kind: str, text: str, rank: int, ts: float, stream: str) -> None:
        entry = entries.get((kind, text))
        if entry is None:
            entry = entries[(kind, text)] = Folded(text, kind, stream, ts, ts)
        entry.count += 1
        entry.ranks.add(rank)
        entry.first_ts = min(entry.first_ts, ts)
        entry.last_ts = max(entry.last_ts, ts)

    for rank, rank_lines in by_rank.items():
        rank_lines.sort(key=lambda x: (x.ts, x.seq))
        tracebacks, rest = split_tracebacks(rank_lines)
        for tb in tracebacks:
            add("traceback", "\n".join(tb.lines), rank, tb.ts, "stderr")
        for line in rest:
            add(line_kind(line.line), line.line, rank, line.ts, line.stream)
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(entries.values(), key=lambda e: (order[e.kind], e.first_ts, e.text))


def first_failure(tracebacks: Iterable[Traceback]) -> Traceback | None:
    """The traceback that came first (the rank that failed first), or None."""
    return min(tracebacks, key=lambda tb: (tb.ts, tb.global_rank), default=None)


def render(entries: Iterable[Folded]) -> list[str]:
    """``[ranks 0-63 x12] warning: ...``; a traceback's lines follow its first, indented."""
    out: list[str] = []
    for e in entries:
        first, *more = e.text.split("\n")
        out.append(f"{e.prefix()} {first}")
        out += [f"    {line}" for line in more]
    return out
