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

What a relay states besides its items' bodies is checked here, before anything
reaches SQLite (``traceml_wire/bounds.py``): its counters (bad or surplus
entries dropped and counted), each item's sender and seq, how many senders one
rbatch holds, and how far a seq may jump past its sender's mark. An item that
fails, or whose body does not decode, is set aside (``ingest/quarantine.py``),
never the rest of the rbatch. Step and phase durations beyond
``MAX_DURATION_NS`` become NULL (not measured), and a NaN scalar becomes the
text 'NaN', which SQLite keeps (it stores a NaN REAL as NULL).

A sender's ranks row holds the identity its hello stated (an agent's own hello,
or the ``peers`` map of the relay that forwarded it: traceml_wire/identity.py
declares the fields), the node fields its relay's ``node`` map states where the
hello did not, and NULL for the rest. The sender id is only a key: nothing is
read out of it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

from traceml_daemon.ingest.quarantine import Quarantined, describe
from traceml_daemon.store.schema import RANK_COLUMNS as RANK_COLUMNS
from traceml_wire.bounds import (
    MAX_DURATION_NS,
    MAX_SENDERS_PER_RBATCH,
    MAX_STATS_KEYS,
    clean_stats,
    counter_ok,
    sender_problem,
    seq_jump_problem,
    seq_problem,
)
from traceml_wire.errors import ProtocolError
from traceml_wire.identity import (
    IDENTITY,
    IDENTITY_FIELDS,
    IDENTITY_NAMES,
    NODE_FIELDS,
    CleanIdentity,
    clean_identity,
)
from traceml_wire.partials import Stats, decode_partials
from traceml_wire.tables import TABLES, Column, columns, decode_batch

log = logging.getLogger("traceml_daemon.ingest.decode")


def _clean(identity: object) -> CleanIdentity:
    """``identity`` as traceml_wire.identity admits it. Validation cleaned what came over
    the wire already (handing back the same object); anything else, a caller's own map
    included, is checked here, the last step before SQLite."""
    if isinstance(identity, CleanIdentity):
        return identity
    return clean_identity(identity if isinstance(identity, dict) else {})


@dataclass
class RankState:
    rank_id: int
    last_seq: int
    global_rank: int | None = None
    node_rank: int | None = None
    session: str | None = None
    attempt: int = 0
    world_size: int | None = None  # as the rank stated it (sizes its history sample)


@dataclass
class Plan:
    """Everything one transaction writes."""

    # table -> its decoded batches, (rank_id, columns), in arrival order. The writer turns
    # each table into the parameters of its multi-row INSERTs (``chunk_statements``) on the
    # database thread, while the event loop decodes the next transaction.
    chunks: dict[str, list[tuple[int, list[Column]]]] = field(default_factory=dict)
    ranks: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # sender -> RANK_COLUMNS row
    # Senders whose identity row is committed already: (rank_id, last_seen, last_seq).
    rank_touches: list[tuple[int, float, int]] = field(default_factory=list)
    # Senders given a full row here, with the identity it holds (committed on commit).
    full_rows: dict[str, _RankTemplate] = field(default_factory=dict)
    relay_stats: dict[str, dict[str, int]] = field(default_factory=dict)  # relay sender -> counters
    agent_drops: dict[str, dict[str, int]] = field(default_factory=dict)  # agent sender -> source -> count
    # rank_id -> its step batches (columns in ``TABLE_COLUMNS["steps"]`` order, read-only),
    # for history and aggregates.
    steps_by_rank: dict[int, list[list[Column]]] = field(default_factory=dict)
    # rank_id -> (step batch, its checked history partials) for the batches that carried
    # them (traceml_wire/partials.py): history merges these instead of folding the rows.
    partials_by_rank: dict[int, list[tuple[list[Column], list[tuple[int, Stats]]]]] = field(default_factory=dict)
    partials_refused: int = 0  # partials that failed their checks (the rows were folded instead)
    rows_stored: int = 0
    duplicates_discarded: int = 0
    bad_bodies: int = 0
    # Batches set aside (ingest/quarantine.py), each a row of ``quarantine``.
    quarantined: list[Quarantined] = field(default_factory=list)
    stats_refused: int = 0  # relay stats and agent drop counters not stored (bad or beyond the cap)
    seq_jumps_refused: int = 0  # items set aside for a seq far past their sender's mark
    durations_nulled: int = 0  # step and phase cells beyond MAX_DURATION_NS, stored as NULL
    # Senders given a ranks row with no identity at all (no hello identity reached us:
    # an older or broken relay), and identity fields refused as out of range or of the
    # wrong type (traceml_wire/identity.py). Each counted once per sender and identity
    # stated, per daemon run: the ranks row is built then, not per batch.
    senders_without_identity: int = 0
    identity_fields_refused: int = 0
    high_water: dict[str, RankState] = field(default_factory=dict)
    epoch: int = 0  # the ingestor's rollback count when this plan was staged
    # sender -> (session, identity, node, now) of its latest item; the ranks row is built
    # once per sender and transaction (in ``Ingestor.staged``), not once per batch.
    rank_sources: dict[str, tuple[str | None, dict[str, Any], dict[str, Any], float]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (
            self.chunks or self.ranks or self.rank_touches or self.rank_sources or self.relay_stats or self.agent_drops
            or self.quarantined
        )

    @property
    def batches_quarantined(self) -> int:
        return len(self.quarantined)

    def rows(self, table: str) -> list[tuple[Any, ...]]:
        """The rows of ``table`` as tuples, rank id first (tests and tools; the writer
        binds the same values, ``store.writer.chunk_statements``)."""
        return [(rank_id, *row) for rank_id, cols in self.chunks.get(table, ()) for row in zip(*cols, strict=True)]


TABLE_COLUMNS: dict[str, tuple[str, ...]] = {name: columns(name) for name in TABLES}
_STEP = TABLE_COLUMNS["steps"].index("step")
_DROP_SOURCE = TABLE_COLUMNS["drops"].index("source")
_DROP_COUNT = TABLE_COLUMNS["drops"].index("count")
_SCALAR_VALUE = TABLE_COLUMNS["scalars"].index("value")
# The steps columns that hold durations (history's metrics and the measured all-reduce).
_DURATIONS = tuple(i for i, name in enumerate(TABLE_COLUMNS["steps"]) if name.endswith("_ns"))
_DURATION_COLUMNS = itemgetter(*_DURATIONS)
_chain = chain.from_iterable
NAN_TEXT = "NaN"  # how a NaN scalar is stored (schema v7)


@dataclass
class _RankTemplate:
    """What a ranks row says besides its ids and times, cached per sender: the
    identity a relay forwards is the same batch after batch."""

    session: str | None
    identity: dict[str, Any]
    node: dict[str, Any]
    middle: tuple[Any, ...]  # RANK_COLUMNS[1:-3]: the sender, then IDENTITY_NAMES
    global_rank: int | None
    node_rank: int | None
    run_session: str
    attempt: int
    world_size: int | None


class Ingestor:
    def __init__(self, known: dict[str, RankState] | None = None, next_rank_id: int = 1) -> None:
        self.known: dict[str, RankState] = dict(known or {})
        self.pending: dict[str, RankState] = {}  # staged, not yet committed
        self.next_rank_id = next_rank_id
        self._templates: dict[str, _RankTemplate] = {}
        # The identity each sender's committed ranks row holds: a sender whose template
        # is that same object needs only its dedup mark updated.
        self._committed: dict[str, _RankTemplate] = {}
        # Per sender, the loss counters as last put in the "drops" table: a row is stored
        # only when its counter changed (agents repeat unchanged counters as a refresh).
        self._drops_stored: dict[str, dict[str, int]] = {}
        # Counts rollbacks: a plan staged before one deduplicated against marks that are
        # gone, so it must not be written or acknowledged as staged (``Plan.epoch``).
        self.epoch = 0

    def statistics(self) -> dict[str, int]:
        """How many senders each long-lived map holds (memory diagnosis)."""
        return {"known": len(self.known), "pending": len(self.pending), "templates": len(self._templates),
                "drops_stored": len(self._drops_stored)}

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
            kept, refused = clean_stats(stats)
            plan.stats_refused += refused
            if kept:
                plan.relay_stats.setdefault(relay_sender, {}).update(kept)
        high_water, pending, known = plan.high_water, self.pending, self.known
        sources = plan.rank_sources
        # Senders are counted only where the items could outnumber the cap.
        admitted: set[str] | None = set() if len(items) > MAX_SENDERS_PER_RBATCH else None
        for sender, seq, body in items:
            problem = sender_problem(sender) or seq_problem(seq)
            if problem is None and admitted is not None and sender not in admitted:
                if len(admitted) < MAX_SENDERS_PER_RBATCH:
                    admitted.add(sender)
                else:
                    problem = f"more than {MAX_SENDERS_PER_RBATCH} senders in one rbatch"
            if problem is not None:
                plan.quarantined.append(Quarantined(relay_sender, sender, seq, problem, body))
                continue
            state = high_water.get(sender)
            if state is not None:
                # Already this plan's own (not yet shared with ``pending``): advance in place.
                if seq <= state.last_seq:
                    plan.duplicates_discarded += 1
                    continue
                if self._jumps(plan, relay_sender, sender, seq, body, state.last_seq):
                    continue
                state.last_seq = seq
            else:
                prior = pending.get(sender) or known.get(sender)
                if prior is not None and seq <= prior.last_seq:
                    plan.duplicates_discarded += 1
                    continue
                # A sender never seen may start anywhere (a database started mid-run): its
                # id holds a random part, so nobody can claim it before it appears.
                if prior is not None and self._jumps(plan, relay_sender, sender, seq, body, prior.last_seq):
                    continue
                if prior is None:
                    state = RankState(rank_id=self.next_rank_id, last_seq=seq)
                    self.next_rank_id += 1
                else:
                    state = RankState(prior.rank_id, seq, prior.global_rank, prior.node_rank, prior.session,
                                      prior.attempt, prior.world_size)
                high_water[sender] = state
            # Seqs advance even when the body is bad: a resend would be equally
            # bad, and refusing it forever would wedge the relay's buffer.
            sources[sender] = (session, peers.get(sender) or {}, node, now)
            try:
                tables, partials = decode_batch(body)
            except ProtocolError as exc:
                plan.bad_bodies += 1
                plan.quarantined.append(Quarantined(relay_sender, sender, seq, f"bad body: {exc}", body))
                continue
            steps = tables.get("steps")
            if steps is not None:
                nulled = _bound_durations(steps)
                if nulled:
                    plan.durations_nulled += nulled
                    if partials is not None:
                        # They counted the cells now NULL: the rows are folded instead.
                        plan.partials_refused += 1
                        partials = None
            scalars = tables.get("scalars")
            if scalars is not None:
                _keep_nan(scalars)
            fingerprints = tables.get("fingerprints")
            if fingerprints is not None:
                _keep_nan_columns(fingerprints, _FINGERPRINT_NORMS)
            self._add_tables(plan, state.rank_id, sender, tables)
            if partials is not None:
                self._add_partials(plan, state.rank_id, sender, seq, tables.get("steps"), partials)

    @staticmethod
    def _jumps(plan: Plan, relay: str, sender: str, seq: int, body: Any, mark: int) -> bool:
        """Set the item aside (its sender's mark stays) when ``seq`` jumps too far past ``mark``."""
        problem = seq_jump_problem(seq, mark)
        if problem is None:
            return False
        plan.seq_jumps_refused += 1
        plan.quarantined.append(Quarantined(relay, sender, seq, problem, body))
        return True

    def _template(
        self, plan: Plan, sender: str, session: str | None, identity: dict[str, Any], node: dict[str, Any]
    ) -> _RankTemplate:
        cached = self._templates.get(sender)
        # The identity dicts are usually the very objects cached (the session's identity
        # cache hands the same cleaned dict back): ``is`` spares comparing them.
        if (
            cached is not None
            and cached.session == session
            and (cached.identity is identity or cached.identity == identity)
            and (cached.node is node or cached.node == node)
        ):
            return cached
        own, relay_node = _clean(identity), _clean(node)
        if not own:
            plan.senders_without_identity += 1
        if own.refused:
            plan.identity_fields_refused += len(own.refused)
            log.warning("identity of %s: dropped %s (wrong type or out of range)", sender, ", ".join(own.refused))
        values: dict[str, Any] = dict(own)
        # Node fields the rank did not state come from the relay that forwarded it
        # (GROUP_RANK on that host), never from the hostname alone.
        for name in NODE_FIELDS:
            if values.get(name) is None and relay_node.get(name) is not None:
                values[name] = relay_node[name]
        # The run is the rank's own word, else that of the connection that brought it
        # (the relay's hello: the relay serves one job), else the declared default.
        if not values.get("session") and session:
            values["session"] = session[: IDENTITY_FIELDS["session"].max_chars]  # hello's is unbounded
        for spec in IDENTITY:
            if spec.default is not None and values.get(spec.name) is None:
                values[spec.name] = spec.default
        world_size = values.get("world_size")
        template = _RankTemplate(
            session=session,
            identity=identity,
            node=node,
            middle=(sender, *(values.get(name) for name in IDENTITY_NAMES)),
            global_rank=values.get("global_rank"),
            node_rank=values.get("node_rank"),
            run_session=values["session"],
            attempt=values["attempt"],
            world_size=world_size,
        )
        self._templates[sender] = template
        return template

    def _add_tables(self, plan: Plan, rank_id: int, sender: str, tables: dict[str, list[Column]]) -> None:
        chunks = plan.chunks
        for name, cols in tables.items():
            if name == "drops":
                # Cumulative counters: the latest value per source wins the delivery figure,
                # and the table keeps each change (when a loss happened), not each repeat.
                cols = self._changed_drops(plan, sender, cols)
                if cols is None:
                    continue
            have = chunks.get(name)
            if have is None:
                chunks[name] = [(rank_id, cols)]
            else:
                have.append((rank_id, cols))
            plan.rows_stored += len(cols[0])  # decode_columns drops empty tables
            if name == "steps":
                # The decoded columns are ours alone, and only ever read from now on:
                # history and the aggregates share them, no copy and no dict per batch.
                batches = plan.steps_by_rank.get(rank_id)
                if batches is None:
                    plan.steps_by_rank[rank_id] = [cols]
                else:
                    batches.append(cols)

    @staticmethod
    def _add_partials(plan: Plan, rank_id: int, sender: str, seq: int, steps: list[Column] | None, raw: Any) -> None:
        try:
            fine = decode_partials(raw, () if steps is None else steps[_STEP])
        except ProtocolError as exc:
            # The rows are stored as sent and history folds them itself: nothing is lost.
            plan.partials_refused += 1
            log.warning("history partials from %s seq %d refused (its steps are folded instead): %s", sender, seq, exc)
            return
        if steps is None or not fine:
            return
        have = plan.partials_by_rank.get(rank_id)
        if have is None:
            plan.partials_by_rank[rank_id] = [(steps, fine)]
        else:
            have.append((steps, fine))

    def _changed_drops(self, plan: Plan, sender: str, cols: list[Column]) -> list[Column] | None:
        """Fold a batch's "drops" rows into the plan's delivery counters; return the rows
        whose counter differs from what the table last got from ``sender`` (None: none)."""
        drops = plan.agent_drops.setdefault(sender, {})
        stored = self._drops_stored.setdefault(sender, {})
        keep: list[int] = []
        for i, (source, count) in enumerate(zip(cols[_DROP_SOURCE], cols[_DROP_COUNT], strict=True)):
            if isinstance(source, str) and isinstance(count, int):
                # A delivery counter each: bounded in name, value and number per sender,
                # as a relay's stats are (the row itself is stored regardless).
                if not counter_ok(source, count) or source not in stored and len(stored) >= MAX_STATS_KEYS:
                    plan.stats_refused += 1
                    keep.append(i)
                    continue
                drops[source] = max(drops.get(source, 0), count)
                if stored.get(source) == count:
                    continue
                stored[source] = count
            keep.append(i)  # a malformed row is stored as sent, as before
        if not keep:
            return None
        if len(keep) == len(cols[0]):
            return cols
        return [[col[i] for i in keep] for col in cols]

    def staged(self, plan: Plan) -> None:
        """``plan`` is on its way to the database: later plans dedup against it.

        Also builds its ranks rows: one per sender, from its latest batch; narrow
        when the sender's committed row already holds this identity."""
        committed = self._committed
        for sender, (session, identity, node, now) in plan.rank_sources.items():
            state = plan.high_water[sender]
            t = self._template(plan, sender, session, identity, node)
            state.global_rank, state.node_rank = t.global_rank, t.node_rank
            state.session, state.attempt, state.world_size = t.run_session, t.attempt, t.world_size
            if committed.get(sender) is t:
                plan.rank_touches.append((state.rank_id, now, state.last_seq))
            else:
                plan.ranks[sender] = (state.rank_id, *t.middle, now, now, state.last_seq)
                plan.full_rows[sender] = t
        plan.rank_sources.clear()
        self.pending.update(plan.high_water)
        if plan.quarantined:
            log.warning("setting aside %s", describe(plan.quarantined))

    def commit(self, plan: Plan) -> None:
        self.known.update(plan.high_water)
        self._committed.update(plan.full_rows)
        for sender, state in plan.high_water.items():
            if self.pending.get(sender) is state:
                del self.pending[sender]

    def discard(self, plan: Plan) -> None:
        """``plan`` failed while being staged: forget the marks it shared (the writer
        stages nothing else until what is in flight has finished, see StoreWriter.run)
        and the drops rows it noted."""
        for sender, state in plan.high_water.items():
            if self.pending.get(sender) is state:
                del self.pending[sender]
        self._drops_stored.clear()

    def rollback(self, plan: Plan) -> None:
        # Rank ids handed out by a failed plan are simply skipped; ids only need to be unique.
        # Every staged plan after it deduplicated against it, so all pending marks go.
        plan.high_water.clear()
        self.pending.clear()
        self.epoch += 1
        # Its drops rows never reached the table: forget what was staged, so the resent
        # batches store them (at worst one repeat per sender).
        self._drops_stored.clear()


def _bound_durations(steps: list[Column]) -> int:
    """Replace, in a batch's steps columns, each duration beyond ``MAX_DURATION_NS``
    either way with None; return how many. A column of cells that are not negative
    and sum to at most the bound has none beyond it: two C-level passes (``min`` and
    ``sum``) decide a usual column, and only a column that fails them is walked."""
    nulled = 0
    for at in _DURATIONS:
        col = steps[at]
        if not col or (col[0] is None and col.count(None) == len(col)):
            continue  # not measured at all (h2d_ns on a CPU job)
        try:
            if min(col) >= 0 and sum(col) <= MAX_DURATION_NS:
                continue
        except TypeError:
            pass  # a None among the cells: the walk below keeps it
        bounded = [v if v is None or -MAX_DURATION_NS <= v <= MAX_DURATION_NS else None for v in col]
        nulled += bounded.count(None) - col.count(None)
        steps[at] = bounded
    return nulled


def _keep_nan(scalars: list[Column]) -> None:
    """Store a NaN scalar as the text 'NaN' (SQLite would store a NaN REAL as NULL, and a
    loss that went NaN would read as one never logged)."""
    col = scalars[_SCALAR_VALUE]
    if not any(map(math.isnan, filter(None, col) if None in col else col)):
        return
    scalars[_SCALAR_VALUE] = [NAN_TEXT if v is not None and v != v else v for v in col]


_FINGERPRINT_NORMS = tuple(TABLE_COLUMNS["fingerprints"].index(c) for c in ("param_norm", "grad_norm"))


def _keep_nan_columns(table: list[Column], at: tuple[int, ...]) -> None:
    """``_keep_nan`` for the REAL columns at ``at`` (a NaN norm is a finding, not a missing value)."""
    for i in at:
        col = table[i]
        if any(v != v for v in col if v is not None):
            table[i] = [NAN_TEXT if v is not None and v != v else v for v in col]


TELEMETRY_TABLES = tuple(TABLES)
