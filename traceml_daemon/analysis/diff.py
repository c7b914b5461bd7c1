"""Compare two runs: step/phase median deltas, verdict changes (by name and culprit), first divergent scalar.

Pure (no I/O). Scalars are keyed by ``scalar_key(name, rank)`` and hold
(step, value) pairs. Divergence is measured in float64 ULPs (units in the last
place) so ``ulp=0`` asks for bitwise-equal values: the test of determinism.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import PHASES, RunData, Verdict
from traceml_daemon.analysis.policy import DEFAULT_POLICY, ComparePolicy, Policy
from traceml_daemon.analysis.scalars import split_key
from traceml_daemon.analysis.stats import median, round_ms
from traceml_daemon.analysis.window import profiles

_MAX_ULP = 2**64  # one side NaN, the other not: as far apart as it gets


def _ordered(x: float) -> int:
    """Map a float64 to an integer that orders like the float, adjacent floats 1 apart."""
    (i,) = struct.unpack("<q", struct.pack("<d", x))
    return i if i >= 0 else -(2**63) - i


def ulp_distance(x: float, y: float) -> int:
    """How many representable float64 values lie between x and y (0 = bitwise equal, and -0.0 == 0.0)."""
    if math.isnan(x) or math.isnan(y):
        return 0 if math.isnan(x) and math.isnan(y) else _MAX_ULP
    return abs(_ordered(float(x)) - _ordered(float(y)))


def _run_medians(run: RunData, policy: Policy) -> dict[str, Any]:
    # Whole post-warm-up run, not the live window: a comparison is about the runs as a whole.
    sp = policy.steps
    profs = [p for p in profiles(run, sp.warmup_steps, None, sp.clock_slack_frac) if p.step_ms is not None]
    return {
        "ranks": len(profs),
        "steps": max((p.n_window for p in profs), default=0),
        "step_ms": median(p.step_ms for p in profs),
        "phases_ms": {ph: median(p.phases_ms.get(ph) for p in profs) for ph in PHASES},
    }


def _delta(metric: str, a: float | None, b: float | None, policy: ComparePolicy) -> dict[str, Any]:
    row: dict[str, Any] = {
        "metric": metric,
        "a_ms": round_ms(a),
        "b_ms": round_ms(b),
        "delta_ms": None,
        "delta_pct": None,
        "verdict": None,
    }
    if a is None or b is None:
        return row
    delta = b - a
    pct = 100.0 * delta / a if a else None
    row["delta_ms"] = round_ms(delta)
    row["delta_pct"] = None if pct is None else round(pct, 2)
    if pct is not None and abs(pct) >= policy.regression_pct and abs(delta) >= policy.min_delta_ms:
        row["verdict"] = "REGRESSION" if delta > 0 else "IMPROVEMENT"
    return row


def _value(x: float) -> float | str:
    # JSON has no NaN/inf: keep them readable as text.
    return x if math.isfinite(x) else repr(x)


def _divergence(key: str, sa: list[tuple[int, float]], sb: list[tuple[int, float]], ulp: int) -> dict[str, Any]:
    va: dict[int, float] = {}
    vb: dict[int, float] = {}
    for step, value in sa:
        va.setdefault(step, value)  # a step logged twice: the first value counts, in both runs alike
    for step, value in sb:
        vb.setdefault(step, value)
    common = sorted(va.keys() & vb.keys())
    name, rank = split_key(key)
    out: dict[str, Any] = {
        "name": name,
        "rank": rank,
        "steps_compared": len(common),
        "steps_only_a": len(va.keys() - vb.keys()),
        "steps_only_b": len(vb.keys() - va.keys()),
        "first_divergent_step": None,
    }
    for step in common:
        d = ulp_distance(va[step], vb[step])
        if d > ulp:
            out.update(
                {
                    "first_divergent_step": step,
                    "a": _value(va[step]),
                    "b": _value(vb[step]),
                    "a_hex": float(va[step]).hex(),
                    "b_hex": float(vb[step]).hex(),
                    "ulp_distance": d,
                    "abs_diff": _value(abs(vb[step] - va[step])) if not math.isnan(vb[step] - va[step]) else "nan",
                }
            )
            break
    return out


def compare_scalars(
    scalars_a: dict[str, list[tuple[int, float]]], scalars_b: dict[str, list[tuple[int, float]]], ulp: int = 0
) -> dict[str, Any]:
    keys = sorted(scalars_a.keys() & scalars_b.keys())
    series = [_divergence(k, scalars_a[k], scalars_b[k], ulp) for k in keys]
    diverged = [s for s in series if s["first_divergent_step"] is not None]
    first = min(
        diverged,
        key=lambda s: (s["first_divergent_step"], s["rank"] if s["rank"] is not None else -1, s["name"]),
        default=None,
    )
    return {
        "ulp": ulp,
        "series_compared": len(series),
        "steps_compared": sum(s["steps_compared"] for s in series),
        "only_a": sorted(scalars_a.keys() - scalars_b.keys()),
        "only_b": sorted(scalars_b.keys() - scalars_a.keys()),
        "identical": bool(series) and not diverged,
        "first_divergence": first,
        "series": series,
    }


def compare_runs(
    a: RunData,
    b: RunData,
    scalars_a: dict[str, list[tuple[int, float]]],
    scalars_b: dict[str, list[tuple[int, float]]],
    ulp: int = 0,
    policy: Policy | None = None,
) -> dict[str, Any]:
    """B against A: median deltas with REGRESSION/IMPROVEMENT, verdict changes and scalar divergence."""
    policy = policy or DEFAULT_POLICY
    ma, mb = _run_medians(a, policy), _run_medians(b, policy)
    deltas = [_delta("step", ma["step_ms"], mb["step_ms"], policy.compare)]
    deltas += [_delta(ph, ma["phases_ms"][ph], mb["phases_ms"][ph], policy.compare) for ph in PHASES]
    va, vb = diagnose(a, policy), diagnose(b, policy)
    return {
        "a": {"ranks": ma["ranks"], "steps": ma["steps"]},
        "b": {"ranks": mb["ranks"], "steps": mb["steps"]},
        "deltas": deltas,
        "verdicts": {"a": [v.to_json() for v in va], "b": [v.to_json() for v in vb], **verdict_changes(va, vb)},
        "scalars": compare_scalars(scalars_a, scalars_b, ulp),
    }


ScopeKey = tuple[tuple[str, int], ...]


def _scope_key(scope: dict[str, int]) -> ScopeKey:
    return tuple(sorted(scope.items()))


def scope_label(scope: dict[str, int]) -> str:
    """'rank 1 (node 0)', 'node 1' or 'run': who a verdict blames."""
    rank, node = scope.get("global_rank"), scope.get("node_rank")
    if rank is not None:
        return f"rank {rank}" + (f" (node {node})" if node is not None else "")
    return f"node {node}" if node is not None else "run"


def _scope_order(key: ScopeKey) -> tuple[int, int, int]:
    # Run-wide first, then nodes, then ranks, each by number: the order a reader scans in.
    d = dict(key)
    rank, node = d.get("global_rank"), d.get("node_rank")
    return (0 if rank is None and node is None else 1 if rank is None else 2, node or 0, rank or 0)


def verdict_changes(va: list[Verdict], vb: list[Verdict]) -> dict[str, Any]:
    """Verdicts of B against A, identified by (name, scope).

    By name alone a straggler that moved from rank 1 to rank 3 looks unchanged,
    although the culprit is a different GPU; so besides the names found in one
    run only (``only_a``/``only_b``), every (name, scope) of one run missing from
    the other is listed, and ``moved`` names the verdicts both runs raise with
    different culprits (``from``/``to``: the scopes found only in A / only in B;
    one of them is empty when a culprit was added or cleared)."""
    ka = {(v.name, _scope_key(v.scope)) for v in va}
    kb = {(v.name, _scope_key(v.scope)) for v in vb}
    names_a, names_b = {n for n, _ in ka}, {n for n, _ in kb}

    def listed(keys: set[tuple[str, ScopeKey]]) -> list[dict[str, Any]]:
        return [{"name": n, "scope": dict(k)} for n, k in sorted(keys, key=lambda t: (t[0], _scope_order(t[1])))]

    def scopes(keys: set[tuple[str, ScopeKey]], name: str) -> list[dict[str, int]]:
        return [dict(k) for k in sorted((k for n, k in keys if n == name), key=_scope_order)]

    moved = [
        {
            "name": name,
            "a": scopes(ka, name),
            "b": scopes(kb, name),
            "from": scopes(ka - kb, name),
            "to": scopes(kb - ka, name),
        }
        for name in sorted(names_a & names_b)
        if scopes(ka, name) != scopes(kb, name)
    ]
    return {
        "only_a": sorted(names_a - names_b),
        "only_b": sorted(names_b - names_a),
        "scoped_only_a": listed(ka - kb),
        "scoped_only_b": listed(kb - ka),
        "moved": moved,
    }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_compare(result: dict[str, Any]) -> str:
    """Readable text of a ``compare_runs`` result."""
    lines = [
        f"Compare: A {result['a']['ranks']} ranks / {result['a']['steps']} steps, "
        f"B {result['b']['ranks']} ranks / {result['b']['steps']} steps (medians after warm-up; delta = B - A)",
        f"  {'metric':<11}{'A ms':>11}{'B ms':>11}{'delta ms':>11}{'delta %':>9}  verdict",
    ]
    for row in result["deltas"]:
        if row["a_ms"] is None and row["b_ms"] is None:
            continue
        lines.append(
            f"  {row['metric']:<11}{_num(row['a_ms'], '.3f'):>11}{_num(row['b_ms'], '.3f'):>11}"
            f"{_num(row['delta_ms'], '+.3f'):>11}{_num(row['delta_pct'], '+.1f'):>9}  {row['verdict'] or ''}"
        )
    v = result["verdicts"]
    lines.append("Verdicts only in A: " + (", ".join(v["only_a"]) or "none"))
    lines.append("Verdicts only in B: " + (", ".join(v["only_b"]) or "none"))
    for m in v.get("moved", []):
        lines.append(
            f"Verdict moved: {m['name']} "
            f"{', '.join(scope_label(sc) for sc in m['a'])} -> {', '.join(scope_label(sc) for sc in m['b'])}"
        )
    s = result["scalars"]
    tol = "bitwise" if s["ulp"] == 0 else f"within {s['ulp']} ULP"
    if not s["series_compared"]:
        lines.append("Scalars: none logged in both runs (agent.log)")
    elif s["first_divergence"] is None:
        lines.append(
            f"Scalars: {s['series_compared']} series identical ({tol}) over {s['steps_compared']} common steps"
        )
    else:
        d = s["first_divergence"]
        who = f"{d['name']}" + (f" (rank {d['rank']})" if d["rank"] is not None else "")
        lines.append(
            f"Scalars: first divergence at step {d['first_divergent_step']}: {who} A={d['a']!r} B={d['b']!r} "
            f"({d['ulp_distance']} ULP apart; tolerance {tol})"
        )
    for side in ("only_a", "only_b"):
        if s[side]:
            lines.append(f"Scalars only in {side[-1].upper()}: {', '.join(s[side])}")
    return "\n".join(lines)
