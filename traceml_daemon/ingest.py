"""Turn rbatches into rows per table, with dedup (pure; no I/O).

The writer owns one ``Ingestor``; it holds, per agent sender, the rank id and
the highest agent seq stored (a cache of ``ranks.last_seq``). ``stage`` plans
one transaction; ``commit`` makes the plan's high-water marks current once the
database committed, and ``rollback`` forgets them, so the cache never runs
ahead of the disk.

The writer pipelines: it stages transaction N+1 (decoding, in the event loop)
while N is still being written on aiosqlite's thread. Staging therefore also
consults ``pending``, the high-water marks of staged but uncommitted plans; a
failed commit clears them all and the writer re-stages what came after.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from traceml_wire.errors import ProtocolError
from traceml_wire.tables import TABLES, columns, decode_body

log = logging.getLogger("traceml_daemon.ingest")

# Agent senders look like "{session}/a{attempt}/n{node}/r{rank}/{pid}-{rand}";
# the session itself may contain slashes, so match from the right.
_AGENT_SENDER = re.compile(r"^(?P<session>.+)/a(?P<attempt>\d+)/n(?P<node>-?\d+)/r(?P<rank>-?\d+)/[^/]+$")

RANK_COLUMNS = (
    "rank_id",
    "sender",
    "session",
    "attempt",
    "global_rank",
    "local_rank",
    "node_rank",
    "world_size",
    "local_world_size",
    "nnodes",
    "hostname",
    "pid",
    "run_id",
    "parallelism",
    "device",
    "first_seen",
    "last_seen",
    "last_seq",
)


@dataclass
class RankState:
    rank_id: int
    last_seq: int
    global_rank: int | None = None
    node_rank: int | None = None
    session: str | None = None
    attempt: int = 0


@dataclass
class Plan:
    """Everything one transaction writes."""

    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    ranks: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # sender -> RANK_COLUMNS row
    relay_stats: dict[str, dict[str, int]] = field(default_factory=dict)  # relay sender -> counters
    agent_drops: dict[str, dict[str, int]] = field(default_factory=dict)  # agent sender -> source -> count
    steps_by_rank: dict[int, dict[str, list[Any]]] = field(default_factory=dict)  # for live aggregates
    rows_stored: int = 0
    duplicates_discarded: int = 0
    bad_bodies: int = 0
    high_water: dict[str, RankState] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.rows or self.ranks or self.relay_stats or self.agent_drops)


@dataclass(frozen=True)
class SenderId:
    session: str
    attempt: int
    node_rank: int
    global_rank: int


def parse_agent_sender(sender: str) -> SenderId | None:
    """What an agent sender id states about its rank, if it has the agent shape."""
    match = _AGENT_SENDER.match(sender)
    if match is None:
        return None
    return SenderId(match["session"], int(match["attempt"]), int(match["node"]), int(match["rank"]))


class Ingestor:
    def __init__(self, known: dict[str, RankState] | None = None, next_rank_id: int = 1) -> None:
        self.known: dict[str, RankState] = dict(known or {})
        self.pending: dict[str, RankState] = {}  # staged, not yet committed
        self.next_rank_id = next_rank_id

    def last_seq(self, sender: str) -> int:
        state = self.known.get(sender)
        return state.last_seq if state else 0

    def stage(
        self,
        plan: Plan,
        *,
        relay_sender: str,
        session: str | None,
        items: list[list[Any]],
        peers: dict[str, dict[str, Any]],
        node: dict[str, Any],
        stats: dict[str, int],
        now: float,
    ) -> None:
        """Add one (validated) rbatch to ``plan``."""
        if stats:
            plan.relay_stats.setdefault(relay_sender, {}).update(stats)
        for sender, seq, body in items:
            state = plan.high_water.get(sender) or self.pending.get(sender) or self.known.get(sender)
            if state is not None and seq <= state.last_seq:
                plan.duplicates_discarded += 1
                continue
            if state is None:
                state = RankState(rank_id=self.next_rank_id, last_seq=0)
                self.next_rank_id += 1
            # Seqs advance even when the body is bad: a resend would be equally
            # bad, and refusing it forever would wedge the relay's buffer.
            state = RankState(state.rank_id, seq, state.global_rank, state.node_rank, state.session, state.attempt)
            plan.high_water[sender] = state
            plan.ranks[sender] = self._rank_row(state, sender, session, peers.get(sender, {}), node, now)
            try:
                tables = decode_body(body)
            except ProtocolError as exc:
                plan.bad_bodies += 1
                log.warning("discarding a bad batch body from %s seq %d: %s", sender, seq, exc)
                continue
            self._add_tables(plan, state.rank_id, sender, tables)

    def _rank_row(
        self,
        state: RankState,
        sender: str,
        session: str | None,
        identity: dict[str, Any],
        node: dict[str, Any],
        now: float,
    ) -> tuple[Any, ...]:
        parsed = parse_agent_sender(sender)
        # The sender id is the agent's own statement of its session; the relay's
        # hello session is the fallback for senders of another shape.
        sess = parsed.session if parsed else (session or "unknown")
        attempt = identity.get("attempt", parsed.attempt if parsed else 0)
        values = dict(identity)
        if parsed is not None:
            values.setdefault("global_rank", parsed.global_rank)
            values.setdefault("node_rank", parsed.node_rank)
        # Otherwise node identity comes from the relay that forwarded it (GROUP_RANK
        # on that host), never from the hostname alone.
        for key in ("node_rank", "hostname"):
            if values.get(key) is None and node.get(key) is not None:
                values[key] = node[key]
        state.global_rank = values.get("global_rank")
        state.node_rank = values.get("node_rank")
        state.session = sess
        state.attempt = attempt if isinstance(attempt, int) else 0
        values.update(
            rank_id=state.rank_id,
            sender=sender,
            session=sess,
            attempt=attempt,
            first_seen=now,
            last_seen=now,
            last_seq=state.last_seq,
        )
        return tuple(values.get(col) for col in RANK_COLUMNS)

    @staticmethod
    def _add_tables(plan: Plan, rank_id: int, sender: str, tables: dict[str, dict[str, list[Any]]]) -> None:
        for name, cols in tables.items():
            order = columns(name)
            n = len(cols[order[0]])
            if n == 0:
                continue
            rid = [rank_id] * n
            plan.rows.setdefault(name, []).extend(zip(rid, *(cols[c] for c in order), strict=True))
            plan.rows_stored += n
            if name == "steps":
                acc = plan.steps_by_rank.setdefault(rank_id, {c: [] for c in order})
                for c in order:
                    acc[c].extend(cols[c])
            elif name == "drops":
                # Cumulative counters: the latest value per source wins.
                drops = plan.agent_drops.setdefault(sender, {})
                for source, count in zip(cols["source"], cols["count"], strict=True):
                    if isinstance(source, str) and isinstance(count, int):
                        drops[source] = max(drops.get(source, 0), count)

    def staged(self, plan: Plan) -> None:
        """``plan`` is on its way to the database: later plans dedup against it."""
        self.pending.update(plan.high_water)

    def commit(self, plan: Plan) -> None:
        self.known.update(plan.high_water)
        for sender, state in plan.high_water.items():
            if self.pending.get(sender) is state:
                del self.pending[sender]

    def rollback(self, plan: Plan) -> None:
        # Rank ids handed out by a failed plan are simply skipped; ids only need to be unique.
        # Every staged plan after it deduplicated against it, so all pending marks go.
        plan.high_water.clear()
        self.pending.clear()


def insert_sql(table: str) -> str:
    cols = ("rank_id", *columns(table))
    return f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"


TELEMETRY_TABLES = tuple(TABLES)
