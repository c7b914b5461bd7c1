"""Columnar row tables: the payload of an agent batch.

A table travels as a map of column name to list (one list per column, all of
equal length). Against a list of per-row maps this is about twice as fast to
pack and unpack and 40% smaller, because keys are written once per batch.

``TABLES`` is the single source of truth for what each table holds; the
agent builds rows with these names and the daemon's SQLite schema mirrors
them (plus the rank id it adds). Unknown tables and unknown columns are
ignored by receivers (additive evolution); a known column with values of the
wrong type is a ProtocolError for that batch.

Units: ``*_ns`` durations in nanoseconds, ``ts`` wall-clock seconds since the
epoch (float), ``*_bytes`` bytes, ``*_pct`` percent. ``None`` means "not
measured", never zero.

Cell types: an INT column holds ints within the signed 64-bit range (what
SQLite stores), a REAL column floats or such ints, a TEXT column str; any may
hold None. A boolean counts as the integer it is (0 or 1), as in Python and
SQLite: checking an int column is then one C-level pack of its cells as int64,
with no per-value type test.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import msgpack

from traceml_wire.bounds import INT64_MAX as INT64_MAX
from traceml_wire.bounds import INT64_MIN as INT64_MIN
from traceml_wire.errors import ProtocolError

INT = "int"
REAL = "real"
TEXT = "text"

PHASES = ("dataloader", "h2d", "forward", "backward", "optimizer", "wait")

TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    # One row per completed training step of one rank.
    "steps": (
        ("step", INT),
        ("ts", REAL),  # wall clock at step end
        ("step_ns", INT),
        ("dataloader_ns", INT),
        ("h2d_ns", INT),
        ("forward_ns", INT),
        ("backward_ns", INT),
        ("optimizer_ns", INT),
        ("wait_ns", INT),  # measured collective wait where DDP is used, residual elsewhere
        ("comm_ns", INT),  # measured all-reduce time (DDP comm hook); None elsewhere
        ("peak_bytes", INT),  # device peak allocated this step (CUDA), None on CPU
        ("reserved_bytes", INT),
        ("rss_bytes", INT),
        ("model_id", INT),  # which traced model (two models in one process)
        # FSDP2 collectives timed inside forward / backward (all-gather, reduce-scatter, HSDP
        # all-reduce), and the part of them on HSDP's replicate dimension; None elsewhere.
        ("fwd_comm_ns", INT),
        ("bwd_comm_ns", INT),
        ("replicate_comm_ns", INT),
        ("post_forward_bytes", INT),  # device allocated after the root forward (FSDP2, CUDA); None on CPU
        # 1: the phases were timed on the device; 0: a GPU step timed on the host only (its
        # device phases None, agent/device_sampling.py); None on CPU.
        ("device_timed", INT),
    ),
    # agent.log(name=value) scalars, resolved lazily.
    "scalars": (("step", INT), ("name", TEXT), ("value", REAL)),
    # agent.span() regions and agent.instant() marks (dur_ns None for instants).
    "spans": (
        ("name", TEXT),
        ("start_ns", INT),  # wall clock, ns since epoch
        ("dur_ns", INT),
        ("step", INT),
        ("args", TEXT),  # JSON object text
        ("category", TEXT),  # free string; compute, comm, io, scheduler, instr predefined
        ("lane", TEXT),  # where it ran: "thread:<name>" or "task:<name>" (an asyncio task)
        ("span_id", INT),  # per-process id, for parent_id
        ("parent_id", INT),  # the enclosing span of the same lane, None at the top
    ),
    # Process sampler, every rank.
    "process": (
        ("ts", REAL),
        ("cpu_pct", REAL),
        ("rss_bytes", INT),
        ("gpu_mem_bytes", INT),
        ("threads", INT),
    ),
    # Host sampler, the node's local rank 0 only.
    "system": (
        ("ts", REAL),
        ("cpu_pct", REAL),
        ("mem_used_bytes", INT),
        ("mem_total_bytes", INT),
        ("net_rx_bps", REAL),
        ("net_tx_bps", REAL),
        ("disk_read_bps", REAL),
        ("disk_write_bps", REAL),
    ),
    # Per-GPU NVML sample, the node's local rank 0 only.
    "gpu": (
        ("ts", REAL),
        ("gpu_index", INT),
        ("util_pct", REAL),
        ("mem_used_bytes", INT),
        ("mem_total_bytes", INT),
        ("temp_c", REAL),
        ("power_w", REAL),
    ),
    # Where each rank is right now (for RANK_STALLED / HANG), sent every flush.
    "status": (
        ("ts", REAL),
        ("phase", TEXT),  # idle|dataloader|h2d|forward|backward|optimizer|wait
        ("phase_since", REAL),
        ("step", INT),  # the step in progress (or last completed when idle)
        ("steps_done", INT),
        ("finished", INT),  # 1 once agent.shutdown() ran
    ),
    # Per-layer deep dive, sampled one step in N.
    "layers": (
        ("step", INT),
        ("layer", TEXT),
        ("forward_ns", INT),
        ("backward_ns", INT),
        ("activation_bytes", INT),
    ),
    # What was traced: sent when a model is first seen (and on reconnect).
    "models": (
        ("model_id", INT),
        ("name", TEXT),
        ("parallelism", TEXT),  # single|ddp|fsdp2
        ("n_modules", INT),
        ("param_bytes", INT),
        ("local_shard_bytes", INT),  # FSDP2 only
        ("estimated_full_bytes", INT),  # FSDP2 only
        ("shard_degree", INT),  # FSDP2: ranks the parameters are sharded over
        ("replicate_degree", INT),  # HSDP: copies of the sharded model (None for 1-D FSDP2)
    ),
    # Cumulative drop/loss counters of the agent (monotonic; latest wins).
    "drops": (("ts", REAL), ("source", TEXT), ("count", INT)),
    # Rollout sessions (agent.session_context): one row when registered (status
    # "pending", unless finalized before the flush) and one when finalized; the
    # newest row of a (rank, session_id) is its state.
    "rollout_sessions": (
        ("task_id", INT),
        ("session_id", INT),
        ("status", TEXT),  # pending|accepted|rejected|failed|dropped
        ("reason", TEXT),
        ("submit_ts", REAL),
        ("finalized_ts", REAL),
        ("open_phases", INT),  # phases still open at finalization (closed with no end)
    ),
    # One row per execution of a session phase (generate, reward, any name), sent at
    # its end, or at finalization with end_ts None when it was left open.
    "session_phases": (
        ("session_id", INT),
        ("phase", TEXT),
        ("start_ts", REAL),
        ("end_ts", REAL),
        ("start_payload", TEXT),  # JSON object text
        ("end_payload", TEXT),
    ),
    # torch.profiler trace files written by the rank (agent.init(profile_steps=...)).
    "profiles": (
        ("step", INT),  # first step profiled
        ("steps", INT),  # how many steps the trace covers
        ("ts", REAL),
        ("path", TEXT),  # where the rank wrote the trace
    ),
    # The rank's stdout/stderr, one row per line as captured at the file descriptor
    # (agent/output_capture.py); seq numbers every line seen, so a gap is a drop.
    "output": (
        ("ts", REAL),  # wall clock when the line was read
        ("stream", TEXT),  # stdout|stderr
        ("seq", INT),
        ("line", TEXT),  # without its newline; cut at the agent's line cap
    ),
    # Numerics fingerprints (agent/fingerprint.py, opt-in): every N steps, one row per
    # parameter tensor of a traced model, taken after the optimizer step.
    "fingerprints": (
        ("step", INT),
        ("model_id", INT),
        ("idx", INT),  # the tensor's position in named_parameters(): "first layer" is the lowest
        ("layer", TEXT),  # the parameter's name
        ("param_norm", REAL),  # L2 norm (float32 accumulation; float64 for a float64 model)
        ("grad_norm", REAL),  # L2 norm of its gradient; None: no gradient
        ("grad_nonfinite", INT),  # NaN and infinite values in the gradient
        ("shard", INT),  # 1: the rank's local shard (FSDP2): the full norm adds the ranks' squares
        ("param_sum", INT),  # the parameter's bits summed as integers, int32 wrapping: equal iff replicas agree
    ),
}

_EXACT_TYPES: dict[str, frozenset[type]] = {
    INT: frozenset({int, bool, type(None)}),
    REAL: frozenset({float, int, bool, type(None)}),
    TEXT: frozenset({str, type(None)}),
}


def columns(table: str) -> tuple[str, ...]:
    return tuple(name for name, _ in TABLES[table])


class TableBuilder:
    """Accumulates rows of one table column by column (cheap appends)."""

    __slots__ = ("name", "_cols", "_order")

    def __init__(self, name: str) -> None:
        self.name = name
        self._order = columns(name)
        self._cols: dict[str, list[Any]] = {c: [] for c in self._order}

    def append(self, row: dict[str, Any]) -> None:
        for col in self._order:
            self._cols[col].append(row.get(col))

    def __len__(self) -> int:
        return len(self._cols[self._order[0]])

    def take(self) -> dict[str, list[Any]]:
        """Return the columns and start empty."""
        out = self._cols
        self._cols = {c: [] for c in self._order}
        return out


def _unpack(body: bytes) -> dict[Any, Any]:
    try:
        # use_list=False: wire arrays become tuples. A tuple of numbers is one
        # allocation instead of two, and the cyclic GC stops tracking it after its
        # first young collection, so rows waiting in the daemon (a transaction, the
        # history backlog) are not walked again and again by older collections.
        raw = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:
        raise ProtocolError(f"batch body is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tables", {}), dict):
        raise ProtocolError("batch body must be a map with a 'tables' map")
    return raw


# SQLite stores 64-bit signed integers; msgpack also carries uint64 up to 2**64 - 1,
# which sqlite3 refuses at bind time (OverflowError): INT64_MAX / INT64_MIN come from
# traceml_wire/bounds.py, the bounds of everything a peer states.

Column = Sequence[Any]  # a tuple as decoded, a list where a missing column was filled


# Per table: column names in order, and per kind the getter of its columns (a
# tuple of columns), so the checks of a whole body are one C-level pass per kind.
@dataclass(frozen=True)
class _Spec:
    names: tuple[str, ...]
    ints: Callable[[list[Column]], tuple[Column, ...]]
    reals: Callable[[list[Column]], tuple[Column, ...]]
    texts: Callable[[list[Column]], tuple[Column, ...]]


def _getter(spec: tuple[tuple[str, str], ...], kind: str) -> Callable[[list[Column]], tuple[Column, ...]]:
    where = [i for i, (_, k) in enumerate(spec) if k == kind]
    if not where:
        return lambda values: ()
    if len(where) == 1:
        only = where[0]
        return lambda values: (values[only],)
    return itemgetter(*where)  # several indexes: a tuple of columns


_SPECS: dict[str, _Spec] = {
    name: _Spec(tuple(col for col, _ in spec), _getter(spec, INT), _getter(spec, REAL), _getter(spec, TEXT))
    for name, spec in TABLES.items()
}
_TUPLE_ONLY = {tuple}
_INT_TYPES = _EXACT_TYPES[INT]
_REAL_TYPES = _EXACT_TYPES[REAL]
_TEXT_TYPES = _EXACT_TYPES[TEXT]
_chain = chain.from_iterable


def decode_columns(body: bytes) -> dict[str, list[Column]]:
    """Like ``decode_body``, but each table is its columns in ``columns(name)`` order.

    The daemon's ingest path: it needs the columns in schema order anyway, and
    skipping the per-table dict saves work on every batch. Columns are read-only
    sequences (tuples as decoded; lists where a missing column was filled with None).

    Fast path: every known column of every known table present, one length per
    table, each INT column's types and int64 range checked by one C-level
    conversion, and the types of all the body's REAL and TEXT cells in one
    C-level pass per kind, never per value in Python. Anything else takes
    ``_exact``, which raises the first problem in table and column order,
    exactly as the column-by-column check always did.
    """
    return _decode_tables(_unpack(body).get("tables", {}))


def decode_batch(body: bytes) -> tuple[dict[str, list[Column]], Any]:
    """``decode_columns`` and the body's history partials as sent (None: none;
    ``traceml_wire.partials.decode_partials`` checks them), from one unpack."""
    raw = _unpack(body)
    return _decode_tables(raw.get("tables", {})), raw.get("history")


def _decode_tables(tables: dict[Any, Any]) -> dict[str, list[Column]]:
    out: dict[str, list[Column]] = {}
    ints: list[Column] = []
    reals: list[Column] = []
    texts: list[Column] = []
    for name, cols in tables.items():
        spec = _SPECS.get(name) if type(name) is str else None
        if spec is None:
            continue
        if type(cols) is not dict:
            return _exact(tables)
        values = list(map(cols.get, spec.names))
        if None in values or _TUPLE_ONLY != set(map(type, values)) or len(set(map(len, values))) != 1:
            return _exact(tables)
        ints += spec.ints(values)
        reals += spec.reals(values)
        texts += spec.texts(values)
        if values[0]:
            out[name] = values
    for col in ints:
        if not col or col[0] is None and col.count(None) == len(col):
            continue  # not measured at all (h2d_ns on a CPU job): common, and cheap to see
        pack = _INT64_PACKERS.get(len(col)) or _int64_packer(len(col))
        try:
            # Ints (and bools) within int64 or an error, in one C pass: cheaper per cell
            # than array("q", col) or a Python scan of types and range.
            pack(*col)
        except struct.error:
            # A None among the ints ("not measured" for some rows), or a wrong cell.
            # Only the top can overflow (msgpack's lowest int is -2**63); filter(None, ...)
            # drops the Nones (and zeros, harmless for a max) in C.
            if not _INT_TYPES.issuperset(map(type, col)) or max(filter(None, col), default=0) > INT64_MAX:
                return _exact(tables)
    if reals:
        kinds = set(map(type, _chain(reals)))
        if not _REAL_TYPES.issuperset(kinds) or int in kinds and not _ints_fit(_chain(reals)):
            return _exact(tables)
    if texts and not _TEXT_TYPES.issuperset(map(type, _chain(texts))):
        return _exact(tables)
    return out


# Packers of n int64 cells, by n: compiling a format costs more than packing a short
# column. Bounded (bodies of many different lengths just rebuild them).
_INT64_PACKERS: dict[int, Callable[..., bytes]] = {}
_INT64_PACKERS_MAX = 1024


def _int64_packer(n: int) -> Callable[..., bytes]:
    if len(_INT64_PACKERS) >= _INT64_PACKERS_MAX:
        _INT64_PACKERS.clear()
    pack = _INT64_PACKERS[n] = struct.Struct(f"{n}q").pack
    return pack


def _ints_fit(values: Iterable[Any]) -> bool:
    return all(INT64_MIN <= v <= INT64_MAX for v in values if type(v) is int)


def _exact(tables: dict[Any, Any]) -> dict[str, list[Column]]:
    """The column-by-column path: missing columns filled with None, errors in order."""
    out: dict[str, list[Column]] = {}
    for name, cols in tables.items():
        spec = _SPECS.get(name) if isinstance(name, str) else None
        if spec is None:
            continue
        if not isinstance(cols, dict):
            raise ProtocolError(f"table {name!r} must be a map of column to list")
        length = _check_columns(name, cols)
        if length:
            out[name] = [(None,) * length if v is None else v for v in map(cols.get, spec.names)]
    return out


def _check_columns(name: str, cols: dict[Any, Any]) -> int | None:
    """The exact check: raise the first problem in column order; else the row count."""
    length: int | None = None
    for col, kind in TABLES[name]:
        values = cols.get(col)
        if values is None:
            continue
        if not isinstance(values, (list, tuple)):
            raise ProtocolError(f"column {name}.{col} must be a list")
        if length is None:
            length = len(values)
        elif len(values) != length:
            raise ProtocolError(f"table {name!r} has columns of different lengths")
        # Exact types, so subclasses other than bool (an int: 0 or 1) are refused.
        bad = set(map(type, values)) - _EXACT_TYPES[kind]
        if bad:
            raise ProtocolError(f"column {name}.{col} holds a {next(iter(bad)).__name__}, expected {kind}")
        if kind != TEXT and int in set(map(type, values)) and not _ints_fit(values):
            raise ProtocolError(f"column {name}.{col} holds an integer outside the signed 64-bit range")
    return length


def decode_body(body: bytes) -> dict[str, dict[str, list[Any]]]:
    """Unpack and validate an agent batch body into known tables/columns.

    Unknown tables and columns are dropped; missing known columns are filled
    with None; wrong types or ragged columns raise ProtocolError.
    """
    return {
        name: {col: list(v) for col, v in zip(_SPECS[name].names, values, strict=True)}
        for name, values in decode_columns(body).items()
    }


def rows(table: dict[str, list[Any]], order: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Columns to row tuples in ``order`` (for executemany)."""
    return list(zip(*(table[c] for c in order), strict=True))

