"""Who a sender is: every identity field, declared once.

A rank's identity travels in its hello (``identity``), in every rbatch a relay
forwards (``peers``: agent sender -> that identity; ``node``: the relay's own
node) and lands in the daemon's ``ranks`` table. ``IDENTITY`` is the one list
of those fields, as ``traceml_wire.tables.TABLES`` is for the telemetry
tables. Derived from it:

  * ``clean_identity``: what a hello or rbatch may state (validation, below);
  * the agent's hello map (``agent.identity.Identity.wire``);
  * the ``ranks`` columns (``traceml_daemon.store.schema.RANK_COLUMNS`` and the
    v6 migration), the rows the daemon builds (``traceml_daemon.ingest.decode``)
    and the rows the readers load (``traceml_daemon.store.reader.RankRow``).

The sender id string is an opaque unique key: nobody parses identity out of it.

Input rules (every field is optional; unknown keys are ignored, for additive
evolution):
  * an INT field takes an int (not a bool) from ``low`` to ``INT64_MAX``, the
    largest integer SQLite stores; a TEXT field takes a str, cut to ``max_chars``;
  * a value of another type or out of range is dropped and its field named in
    ``CleanIdentity.refused`` (the daemon counts them); ``None`` means "not stated";
  * where the field's own name is absent, an older name in ``aliases`` is read.

Fields are only ever appended: the daemon's schema creates the first
``len(IDENTITY)`` at the time of its v6 step and adds each later one by a
migration step of its own (traceml_daemon/store/migrations/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traceml_wire.errors import ProtocolError
from traceml_wire.tables import INT, TEXT

INT64_MAX = 2**63 - 1  # SQLite's INTEGER is a signed 64-bit int
MAX_CHARS = 256  # longest text value kept (traceml_wire/framing.py budgets the rbatch envelope on it)


@dataclass(frozen=True)
class IdentityField:
    name: str  # the key on the wire and the column of ``ranks``
    kind: str  # INT or TEXT (traceml_wire.tables)
    low: int = 0  # INT: the smallest value that means something
    max_chars: int = MAX_CHARS  # TEXT: longer values are cut to this
    aliases: tuple[str, ...] = ()  # older keys still read on input
    node: bool = False  # a relay's ``node`` map may state it for the ranks it forwards
    default: int | str | None = None  # stored when no channel states it (None: NULL)


IDENTITY: tuple[IdentityField, ...] = (
    # The run every rank of one job shares (TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...).
    # Readers key runs by it, so it is never NULL. Agents before schema v6 sent it
    # as "run_id" (and the daemon stored both names): the old key is still read.
    IdentityField("session", TEXT, aliases=("run_id",), default="unknown"),
    IdentityField("attempt", INT, default=0),  # torchelastic restart count; readers key runs by it too
    IdentityField("global_rank", INT),
    IdentityField("local_rank", INT),
    # GROUP_RANK / NODE_RANK / SLURM_NODEID of the rank's host, never its hostname.
    IdentityField("node_rank", INT, node=True),
    IdentityField("world_size", INT, low=1),
    IdentityField("local_world_size", INT, low=1),
    IdentityField("nnodes", INT, low=1),
    IdentityField("hostname", TEXT, node=True),  # shown to people; two nodes may share one
    IdentityField("pid", INT),
    IdentityField("parallelism", TEXT),  # "single" | "ddp" | "fsdp2"
    IdentityField("device", TEXT),
)

IDENTITY_FIELDS: dict[str, IdentityField] = {f.name: f for f in IDENTITY}
IDENTITY_NAMES: tuple[str, ...] = tuple(IDENTITY_FIELDS)
IDENTITY_INT_FIELDS: tuple[str, ...] = tuple(f.name for f in IDENTITY if f.kind == INT)
IDENTITY_STR_FIELDS: tuple[str, ...] = tuple(f.name for f in IDENTITY if f.kind == TEXT)
NODE_FIELDS: tuple[str, ...] = tuple(f.name for f in IDENTITY if f.node)


class CleanIdentity(dict[str, Any]):
    """An identity map of declared fields with valid values only (a plain map on the
    wire); ``refused`` names the declared fields that were stated but dropped."""

    __slots__ = ("refused",)

    def __init__(self) -> None:
        super().__init__()
        self.refused: tuple[str, ...] = ()


def _valid(spec: IdentityField, value: object) -> Any:
    """``value`` as stored, or None when the field cannot take it."""
    if spec.kind == INT:
        # ``type() is int``: a bool is an int to Python, never a rank to us.
        return value if type(value) is int and spec.low <= value <= INT64_MAX else None
    return value[: spec.max_chars] if isinstance(value, str) else None


def clean_identity(raw: object) -> CleanIdentity:
    """Keep the declared fields of ``raw`` whose values are valid; drop the rest
    (unknown keys silently, refused values named in ``refused``). A non-map is a
    ProtocolError: the hello (or rbatch) itself is malformed."""
    if not isinstance(raw, dict):
        raise ProtocolError("hello identity must be a map")
    out = CleanIdentity()
    refused: list[str] = []
    for spec in IDENTITY:
        value = raw.get(spec.name)
        if value is None:
            value = next((raw[old] for old in spec.aliases if raw.get(old) is not None), None)
            if value is None:
                continue
        valid = _valid(spec, value)
        if valid is None:
            refused.append(spec.name)
        else:
            out[spec.name] = valid
    out.refused = tuple(refused)
    return out
