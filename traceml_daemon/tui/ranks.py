"""One rank as the TUI keeps it between refreshes: identity, stored step bounds,
newest status and its recent window.

The window is ``analysis.rolling.RankWindow``, the one the daemon keeps for
``/metrics`` and diagnosis, so the TUI's medians are computed the same way: over
each series' newest ``window`` measured values. The rows come from the read
layer (``store.read.steps``); nothing here reads the database.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from traceml_daemon.analysis.model import RankStatus
from traceml_daemon.analysis.rolling import RankWindow
from traceml_daemon.store.read.steps import STEP_COLS
from traceml_daemon.store.reader import RankRow as StoredRank
from traceml_daemon.tui.model import RankRow

_PEAK_AT, _RSS_AT = STEP_COLS.index("peak_bytes"), STEP_COLS.index("rss_bytes")
_BY_STEP = itemgetter(0)


@dataclass(eq=False)
class LiveRank:
    rank_id: int
    global_rank: int
    local_rank: int | None
    node_rank: int
    hostname: str | None
    first_seen: float | None
    window: RankWindow
    first_step: int | None = None  # stored bounds: from the steps index, then the tail
    last_step: int | None = None
    latest: tuple[Any, ...] | None = None  # the newest step's row (STEP_COLS), for memory
    times: deque[tuple[int, Any]] = field(default_factory=deque)  # (step, ts) of the window's steps
    status: RankStatus | None = None
    _row: RankRow | None = None  # cache, reset when steps or the status change

    @classmethod
    def of(cls, rank: StoredRank, window: int) -> LiveRank:
        global_rank = int(rank.global_rank if rank.global_rank is not None else rank.rank_id)
        node_rank = int(rank.node_rank or 0)
        return cls(
            rank_id=rank.rank_id,
            global_rank=global_rank,
            local_rank=rank.local_rank,
            node_rank=node_rank,
            hostname=rank.hostname,
            first_seen=rank.first_seen,
            window=RankWindow(rank.rank_id, global_rank, node_rank, window=window),
            times=deque(maxlen=window),
        )

    def add(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Steps read from the database (``STEP_COLS`` rows), oldest first."""
        if not rows:
            return
        self.window.add(dict(zip(STEP_COLS, zip(*rows, strict=True), strict=True)))
        for row in rows:
            step = row[0]
            if step is None:
                continue
            if self.last_step is None or step > self.last_step:
                self.last_step = step
            if self.first_step is None or step < self.first_step:
                self.first_step = step
            if self.latest is None or step >= self.latest[0]:
                self.latest = row
            self.times.append((step, row[1]))
        self._row = None

    def set_status(self, status: RankStatus | None) -> None:
        """Keep ``status`` unless the one held is newer."""
        if status is not None and (self.status is None or status.ts >= self.status.ts):
            self.status = status
            self._row = None

    def steps_per_s(self) -> float | None:
        """Steps done per second of wall time across the window, None with fewer than two timed steps."""
        if len(self.times) < 2:
            return None
        (s0, t0), (s1, t1) = min(self.times, key=_BY_STEP), max(self.times, key=_BY_STEP)
        if t0 is None or t1 is None or t1 <= t0:
            return None
        return (s1 - s0) / (t1 - t0)

    def row(self) -> RankRow:
        """The rank's line in the tables: step and phase medians over the window."""
        if self._row is None:
            step_ms, phases, _busy = self.window.medians()
            latest = self.latest
            steps = 0 if self.last_step is None or self.first_step is None else self.last_step - self.first_step + 1
            self._row = RankRow(
                rank_id=self.rank_id,
                global_rank=self.global_rank,
                local_rank=self.local_rank,
                node_rank=self.node_rank,
                hostname=self.hostname,
                steps=steps,
                last_step=self.last_step,
                step_ms=step_ms,
                phase_ms=dict(phases),
                rss_bytes=latest[_RSS_AT] if latest else None,
                peak_bytes=latest[_PEAK_AT] if latest else None,
                status_phase=self.status.phase if self.status else None,
            )
        return self._row
