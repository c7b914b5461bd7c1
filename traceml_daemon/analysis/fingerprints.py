"""Numerics fingerprints: replicas that drifted apart, gradients gone non-finite, two runs that part.

The agent sends, every N steps, each parameter tensor's norm and bit sum (its
bits summed as wrapping int32: equal exactly when the tensors are, for one
changed element), its gradient's norm and non-finite count
(``agent/fingerprint.py``). Pure: the
read layer (``store/read/fingerprints.py``) finds the steps that matter and
hands their rows here.

* ``REPLICA_DIVERGED``: under DDP every rank holds the same parameters after
  each step, bit for bit, so their fingerprints are equal. At the first step
  where they are not, the ranks whose values differ from the majority and the
  first layer (lowest position in ``named_parameters``) where they differ are
  named. A desynchronised rank or silent data corruption looks like this.
* ``GRAD_NONFINITE``: the first step, rank and layer whose gradient held NaN
  or infinite values.
* ``compare_fingerprints``: the first step where two runs' fingerprints differ
  beyond a ULP tolerance, the first layer at that step and both values.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.analysis.policy import NumericsPolicy


@dataclass(frozen=True)
class FingerprintRow:
    global_rank: int
    step: int
    model_id: int
    idx: int
    layer: str
    param_norm: float | None
    grad_norm: float | None
    grad_nonfinite: int | None
    param_sum: int | None = None  # None: taken before bit sums existed


@dataclass
class FingerprintEvidence:
    """What the reader found in one run's fingerprints."""

    ranks: int = 0  # ranks that sent any
    mismatch: list[FingerprintRow] = field(default_factory=list)  # every rank's rows at the first disagreement
    nonfinite: list[FingerprintRow] = field(default_factory=list)  # rows with non-finite grads, first such step


# A layer's fingerprint on one rank: the four numbers, floats as their bits (NaN equals NaN).
Key = tuple[int, int]  # (model_id, idx)


def _bits(x: float | None) -> int | None:
    return None if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _value(x: float | None) -> float | str | None:
    # JSON has no NaN/inf: keep them readable as text.
    return x if x is None or math.isfinite(x) else repr(x)


def _signature(row: FingerprintRow, exact: bool) -> tuple[int | None, ...]:
    """What replicas must agree on. With bit sums on every rank (``exact``), those, the
    non-finite count and whether there is a gradient: float norms may round differently
    on another CPU or kernel while the tensors are equal. Without, the norms' bits."""
    if exact:
        return row.param_sum, row.grad_nonfinite, row.grad_norm is None
    return _bits(row.param_norm), _bits(row.grad_norm), row.grad_nonfinite


def _numbers(row: FingerprintRow) -> dict[str, Any]:
    return {
        "param_norm": _value(row.param_norm),
        "param_norm_hex": None if row.param_norm is None else float(row.param_norm).hex(),
        "grad_norm": _value(row.grad_norm),
        "grad_nonfinite": row.grad_nonfinite,
        "param_sum": row.param_sum,
    }


def replica_verdicts(found: FingerprintEvidence | None, parallelism: str, policy: NumericsPolicy) -> list[Verdict]:
    """REPLICA_DIVERGED at the first step where DDP replicas' fingerprints differ."""
    if found is None or parallelism != "ddp" or not found.mismatch or found.ranks < policy.replica_min_ranks:
        return []
    by_layer: dict[Key, dict[int, FingerprintRow]] = {}
    for row in found.mismatch:
        by_layer.setdefault((row.model_id, row.idx), {})[row.global_rank] = row
    step = found.mismatch[0].step
    differing: set[int] = set()
    first: tuple[Key, set[int], dict[int, FingerprintRow], int] | None = None
    layers_differing = 0
    for key in sorted(by_layer):
        rows = by_layer[key]
        exact = all(r.param_sum is not None for r in rows.values())
        sigs = {g: _signature(r, exact) for g, r in rows.items()}
        counts = Counter(sigs.values())
        if len(counts) < 2:
            continue
        layers_differing += 1
        # The majority's value; a tie goes to the value of the lowest rank holding a tied one.
        top = max(counts.values())
        tied = {sig for sig, n in counts.items() if n == top}
        majority = next(sigs[g] for g in sorted(rows) if sigs[g] in tied)
        off = {g for g in rows if sigs[g] != majority}
        differing |= off
        if first is None:
            first = (key, off, rows, min(g for g in rows if sigs[g] == majority))
    if first is None:
        return []
    (model_id, idx), off, rows, ref_rank = first
    ref = rows[ref_rank]
    ranks = sorted(differing)
    listed = ranks[: policy.max_ranks_listed]
    clear_majority = len(off) * 2 < len(rows)
    who = ", ".join(str(g) for g in sorted(off))
    return [
        Verdict(
            "REPLICA_DIVERGED",
            "critical",
            {"global_rank": min(off)},
            f"at step {step} rank(s) {who} hold different {ref.layer} than "
            + ("the other ranks" if clear_majority else "rank " + str(min(set(rows) - off)) + " (no majority)")
            + ": DDP replicas must be bit-identical after every step",
            {
                "step": step,
                "layer": ref.layer,
                "model_id": model_id,
                "layer_index": idx,
                "ranks": listed,
                "ranks_total": len(ranks),
                "majority": clear_majority,
                "majority_ranks": sorted(set(rows) - off)[: policy.max_ranks_listed],
                "expected": _numbers(ref),
                "found": {str(g): _numbers(rows[g]) for g in sorted(off)[: policy.max_ranks_listed]},
                "layers_differing": layers_differing,
            },
            "A rank whose parameters drift from the others trains a different model: look for code that "
            "changes parameters or buffers on one rank only (rank-dependent init, a manual update outside the "
            "optimizer, a skipped all-reduce), nondeterministic kernels, or faulty hardware on that rank's node "
            "(silent data corruption: rerun the step there).",
        )
    ]


def nonfinite_grad_verdicts(found: FingerprintEvidence | None, policy: NumericsPolicy) -> list[Verdict]:
    """GRAD_NONFINITE at the first fingerprinted step whose gradients held NaN or infinite values."""
    if found is None or not found.nonfinite:
        return []
    rows = sorted(found.nonfinite, key=lambda r: (r.step, r.global_rank, r.model_id, r.idx))
    first = rows[0]
    ranks = sorted({r.global_rank for r in rows})
    layers = sorted({(r.model_id, r.idx, r.layer) for r in rows if r.global_rank == first.global_rank})
    return [
        Verdict(
            "GRAD_NONFINITE",
            "critical",
            {"global_rank": first.global_rank},
            f"gradients of {first.layer} held {first.grad_nonfinite} NaN/inf value(s) at step {first.step} on "
            f"rank {first.global_rank}" + (f", {len(ranks) - 1} more rank(s) at that step" if len(ranks) > 1 else ""),
            {
                "step": first.step,
                "global_rank": first.global_rank,
                "layer": first.layer,
                "layer_index": first.idx,
                "model_id": first.model_id,
                "grad_nonfinite": first.grad_nonfinite,
                "layers": [name for _m, _i, name in layers][: policy.max_layers_listed],
                "layers_total": len(layers),
                "ranks": ranks[: policy.max_ranks_listed],
                "ranks_total": len(ranks),
            },
            "The first layer named is where the NaN/inf entered the backward pass (or its input): check the "
            "loss and activations of that step, mixed-precision loss scaling, the learning rate, and run that "
            "step under torch.autograd.detect_anomaly.",
        )
    ]


# ----------------------------------------------------------------------- two runs

# One run's fingerprints: (model_id, idx, layer, global rank or None when shards were combined)
# -> step -> (param_norm, grad_norm, grad_nonfinite, param_sum).
Series = dict[tuple[int, int, str, int | None],
              dict[int, tuple[float | None, float | None, int | None, int | None]]]

_MAX_ULP = 2**64


def _ordered(x: float) -> int:
    (i,) = struct.unpack("<q", struct.pack("<d", x))
    return i if i >= 0 else -(2**63) - i


def _ordered32(x: float) -> int | None:
    """x's position on the float32 grid, None when x is not a float32 value."""
    try:
        packed = struct.pack("<f", x)
    except OverflowError:
        return None
    (back,) = struct.unpack("<f", packed)
    if back != x:
        return None
    (i,) = struct.unpack("<i", packed)
    return i if i >= 0 else -(2**31) - i


def _ulps(x: float | None, y: float | None) -> int:
    """ULPs apart, counted on the float32 grid when both are float32 values (the agent's
    norms accumulate in float32), else on float64's."""
    if x is None or y is None:
        return 0 if x is None and y is None else _MAX_ULP
    if math.isnan(x) or math.isnan(y):
        return 0 if math.isnan(x) and math.isnan(y) else _MAX_ULP
    a, b = _ordered32(float(x)), _ordered32(float(y))
    if a is not None and b is not None:
        return abs(a - b)
    return abs(_ordered(float(x)) - _ordered(float(y)))


def compare_fingerprints(a: Series, b: Series, ulp: int = 0) -> dict[str, Any]:
    """The first step where the runs' fingerprints differ beyond ``ulp`` ULPs (the non-finite count
    exactly; at ``ulp`` 0 the bit sums too, when both runs took them), the first layer at that step
    (lowest model, then position), both values."""
    keys = sorted(a.keys() & b.keys(), key=lambda k: (k[0], k[1], -1 if k[3] is None else k[3]))
    first: tuple[tuple[int, int, int, int], dict[str, Any]] | None = None
    steps: set[int] = set()
    for key in keys:
        sa, sb = a[key], b[key]
        common = sorted(sa.keys() & sb.keys())
        steps.update(common)
        for step in common:
            va, vb = sa[step], sb[step]
            dp, dg = _ulps(va[0], vb[0]), _ulps(va[1], vb[1])
            bits = ulp == 0 and va[3] is not None and vb[3] is not None and va[3] != vb[3]
            if dp <= ulp and dg <= ulp and va[2] == vb[2] and not bits:
                continue
            model_id, idx, layer, rank = key
            order = (step, model_id, idx, -1 if rank is None else rank)
            if first is None or order < first[0]:
                what = ("param_norm" if dp > ulp else "grad_norm" if dg > ulp
                        else "grad_nonfinite" if va[2] != vb[2] else "param_sum")
                first = (order, {
                    "step": step, "layer": layer, "layer_index": idx, "model_id": model_id, "rank": rank,
                    "metric": what,
                    "a": {"param_norm": _value(va[0]), "grad_norm": _value(va[1]), "grad_nonfinite": va[2],
                          "param_sum": va[3]},
                    "b": {"param_norm": _value(vb[0]), "grad_norm": _value(vb[1]), "grad_nonfinite": vb[2],
                          "param_sum": vb[3]},
                    "a_hex": None if va[0] is None else float(va[0]).hex(),
                    "b_hex": None if vb[0] is None else float(vb[0]).hex(),
                    "ulp_distance": dp if dp > ulp else dg if dg > ulp else 0,
                })
            break  # later steps of this layer cannot come first
    return {
        "ulp": ulp,
        "layers_compared": len(keys),
        "steps_compared": len(steps),
        "only_a": len(a.keys() - b.keys()),
        "only_b": len(b.keys() - a.keys()),
        "identical": bool(keys) and first is None,
        "first_divergence": None if first is None else first[1],
    }


def format_fingerprints(result: dict[str, Any]) -> str:
    """One line (two at a divergence) for compare's text output."""
    tol = "bitwise" if result["ulp"] == 0 else f"within {result['ulp']} ULP"
    if not result["layers_compared"]:
        return "Fingerprints: none in both runs (agent.init(fingerprint_every=N))"
    d = result["first_divergence"]
    if d is None:
        return (f"Fingerprints: {result['layers_compared']} layers identical ({tol}) over "
                f"{result['steps_compared']} common steps")
    who = f" rank {d['rank']}" if d["rank"] is not None else ""
    if d["metric"] == "param_sum":
        return (f"Fingerprints: first divergence at step {d['step']}, layer {d['layer']}{who}: param_sum "
                f"A={d['a']['param_sum']} B={d['b']['param_sum']} (equal norms, different bits; tolerance {tol})")
    return (f"Fingerprints: first divergence at step {d['step']}, layer {d['layer']}{who}: {d['metric']} "
            f"A={d['a'][d['metric']]!r} B={d['b'][d['metric']]!r} ({d['ulp_distance']} ULP apart; tolerance {tol})")
