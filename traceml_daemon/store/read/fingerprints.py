"""A run's numerics fingerprints (``fingerprints`` table, agent/fingerprint.py), read-only.

``evidence`` finds, in SQL, the two steps the verdicts need (the first where the
ranks' fingerprints of a DDP-wrapped model disagree, the first with non-finite
gradients) and reads only
their rows; ``series`` reads every row for ``compare``, adding FSDP2 shards' squares
into each layer's full norm and their bit sums (mod 2**32) into its full sum. A database
from before fingerprints has no such table: both then return nothing; one from before bit
sums (schema v12) reads them as None.
"""

from __future__ import annotations

import math
import sqlite3

from traceml_daemon.analysis.fingerprints import FingerprintEvidence, FingerprintRow, Series
from traceml_daemon.store.read.connect import has_table
from traceml_daemon.store.read.runs import RunRef

_RUN = "FROM fingerprints f JOIN ranks r ON r.rank_id = f.rank_id WHERE r.session = ? AND r.attempt = ?"
_ROW = ("SELECT COALESCE(r.global_rank, r.rank_id), f.step, f.model_id, f.idx, f.layer, f.param_norm, f.grad_norm, "
        "f.grad_nonfinite, {sum} ")

# A (step, layer) whose ranks disagree: with bit sums on every rank, more than one distinct sum or
# non-finite count (float norms may round differently on another CPU while the tensors are equal);
# without (older rows), more than one distinct value of the norms or count. Or a value some ranks
# have and others lack. COUNT(DISTINCT) compares exactly, REALs bit for bit.
# Only models the ranks traced as DDP-wrapped: another model a rank traces may differ by design.
_DDP_MODEL = ("EXISTS (SELECT 1 FROM models m WHERE m.rank_id = f.rank_id AND m.model_id = f.model_id "
              "AND m.parallelism = 'ddp')")
_FIRST_MISMATCH = (
    f"SELECT f.step {_RUN} AND f.step >= ? AND {_DDP_MODEL} GROUP BY f.step, f.model_id, f.idx "
    "HAVING COUNT(*) > 1 AND ("
    "COUNT(DISTINCT f.grad_nonfinite) > 1 OR (CASE WHEN COUNT({sum}) = COUNT(*) THEN COUNT(DISTINCT {sum}) > 1 "
    "ELSE COUNT(DISTINCT f.param_norm) > 1 OR COUNT(DISTINCT f.grad_norm) > 1 END) "
    "OR COUNT(f.param_norm) NOT IN (0, COUNT(*)) OR COUNT(f.grad_norm) NOT IN (0, COUNT(*))) "
    "ORDER BY f.step LIMIT 1"
)
_WRAP = 2**32


def _sum_column(conn: sqlite3.Connection) -> str:
    """f.param_sum, or NULL on a database not migrated to v12 yet (read-only readers)."""
    cols = {row[1] for row in conn.execute("PRAGMA table_info(fingerprints)")}
    return "f.param_sum" if "param_sum" in cols else "NULL"


def _float(x: object) -> float | None:
    # A NaN norm is stored as the text 'NaN' (ingest/decode.py); float() reads it back.
    return None if x is None else float(x)  # type: ignore[arg-type]


def _int(x: object) -> int | None:
    return None if x is None else int(x)  # type: ignore[call-overload]


def _row(values: tuple[object, ...]) -> FingerprintRow:
    g, step, model_id, idx, layer, pn, gn, nf, bits = values
    return FingerprintRow(int(g), int(step), int(model_id or 0), int(idx or 0), str(layer or ""),  # type: ignore[call-overload]
                          _float(pn), _float(gn), _int(nf), _int(bits))


def evidence(conn: sqlite3.Connection, run: RunRef, since_step: int | None = None) -> FingerprintEvidence | None:
    """The rows REPLICA_DIVERGED and GRAD_NONFINITE look at; None when the run has no fingerprints.
    ``since_step``: only steps from there on (a live view's window), else the whole run."""
    if not has_table(conn, "fingerprints"):
        return None
    args: tuple[object, ...] = (run.session, run.attempt, -1 if since_step is None else since_step)
    (ranks,) = conn.execute(f"SELECT COUNT(DISTINCT f.rank_id) {_RUN}", args[:2]).fetchone()
    if not ranks:
        return None
    found = FingerprintEvidence(ranks=int(ranks))
    col = _sum_column(conn)
    row_sql = _ROW.format(sum=col)
    first = conn.execute(_FIRST_MISMATCH.format(sum=col), args).fetchone()
    if first is not None:
        found.mismatch = [_row(v) for v in conn.execute(f"{row_sql}{_RUN} AND f.step = ? AND {_DDP_MODEL}",
                                                        (*args[:2], first[0]))]
    (bad,) = conn.execute(f"SELECT MIN(f.step) {_RUN} AND f.grad_nonfinite > 0 AND f.step >= ?", args).fetchone()
    if bad is not None:
        found.nonfinite = [
            _row(v) for v in conn.execute(f"{row_sql}{_RUN} AND f.step = ? AND f.grad_nonfinite > 0", (*args[:2], bad))
        ]
    return found


def series(conn: sqlite3.Connection, run: RunRef) -> Series:
    """Every fingerprint of the run by (model, position, layer, rank) and step; shards (FSDP2)
    are added up across ranks into one full norm per layer (rank None)."""
    out: Series = {}
    if not has_table(conn, "fingerprints"):
        return out
    sharded: dict[tuple[int, int, str], dict[int, list[float | int | None]]] = {}
    for g, step, model_id, idx, layer, pn, gn, nf, shard, bits in conn.execute(
        "SELECT COALESCE(r.global_rank, r.rank_id), f.step, f.model_id, f.idx, f.layer, f.param_norm, f.grad_norm, "
        f"f.grad_nonfinite, f.shard, {_sum_column(conn)} {_RUN} AND f.step IS NOT NULL "
        "ORDER BY f.step, r.global_rank, f.idx",
        (run.session, run.attempt),
    ):
        key = (int(model_id or 0), int(idx or 0), str(layer or ""))
        if shard:
            acc = sharded.setdefault(key, {}).setdefault(step, [0.0, 0.0, 0, 0])
            _add_square(acc, 0, _float(pn))
            _add_square(acc, 1, _float(gn))
            acc[2] = None if acc[2] is None or nf is None else int(acc[2]) + int(nf)
            acc[3] = None if acc[3] is None or bits is None else (int(acc[3]) + int(bits)) % _WRAP
            continue
        out.setdefault((*key, int(g)), {}).setdefault(step, (_float(pn), _float(gn), _int(nf), _int(bits)))
    for key, steps in sharded.items():
        out[(*key, None)] = {
            step: (_root(acc[0]), _root(acc[1]), _int(acc[2]), _signed32(acc[3]))
            for step, acc in steps.items()
        }
    return out


def _signed32(x: float | int | None) -> int | None:
    # The shards' sums added mod 2**32, as the int32 the agent sends for a whole tensor.
    if x is None:
        return None
    v = int(x) % _WRAP
    return v - _WRAP if v >= 2**31 else v


def _add_square(acc: list[float | int | None], at: int, norm: float | None) -> None:
    current = acc[at]
    acc[at] = None if current is None or norm is None else float(current) + norm * norm


def _root(x: float | int | None) -> float | None:
    return None if x is None else math.sqrt(float(x))
