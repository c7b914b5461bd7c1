"""Node views and skews: per-node medians and the worst rank of each node.

Shared by the engine, the final summary and the TUI so every place shows the
same numbers. The worst rank is the one with the most busy time (step minus
wait), because under DDP every rank reports the same step time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from traceml_daemon.analysis.model import RunData
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy
from traceml_daemon.analysis.stats import median, round_ms
from traceml_daemon.analysis.window import RankProfile, profiles

R = TypeVar("R")


def worst_key(step_ms: float | None, busy_ms: float | None) -> tuple[float, float]:
    """Sort key picking a node's worst rank (``max``): the most busy time, then step time.

    ``busy_ms`` is step minus wait where wait is measured (else the step itself):
    under DDP every rank reports the same step time, so step time alone cannot
    tell the straggler. Shared with the live aggregates and the history overview."""
    return (busy_ms if busy_ms is not None else step_ms or 0.0, step_ms or 0.0)


def by_node_with_worst(
    ranks: Iterable[R], node_of: Callable[[R], int | None], step_of: Callable[[R], float | None],
    busy_of: Callable[[R], float | None],
) -> list[tuple[int, list[R], R | None]]:
    """Group ranks by node (ranks without one are left out), in node order, each
    with its worst timed rank by ``worst_key`` (None when no rank is timed yet)."""
    groups: dict[int, list[R]] = {}
    for r in ranks:
        node = node_of(r)
        if node is not None:
            groups.setdefault(node, []).append(r)
    out = []
    for node in sorted(groups):
        timed = [r for r in groups[node] if step_of(r) is not None]
        worst = max(timed, key=lambda r: worst_key(step_of(r), busy_of(r))) if timed else None
        out.append((node, groups[node], worst))
    return out


def _profiles(run: RunData, policy: Policy | None) -> list[RankProfile]:
    p = (policy or DEFAULT_POLICY).steps
    return [x for x in profiles(run, p.warmup_steps, p.window, p.clock_slack_frac) if x.step_ms is not None]


def node_views(run: RunData, policy: Policy | None = None) -> list[dict[str, Any]]:
    """One dict per node, by node_rank: ranks, medians and its worst rank.

    Ranks without a node_rank are left out (no node to place them in).
    """
    by_node: dict[int, list[RankProfile]] = {}
    for prof in _profiles(run, policy):
        if prof.node_rank is not None:
            by_node.setdefault(prof.node_rank, []).append(prof)
    out: list[dict[str, Any]] = []
    for node_rank in sorted(by_node):
        members = by_node[node_rank]
        worst = max(members, key=lambda p: worst_key(p.step_ms, p.busy_ms))
        out.append(
            {
                "node_rank": node_rank,
                "hostname": next((p.hostname for p in members if p.hostname), None),
                "ranks": sorted(p.global_rank for p in members),
                "step_ms_median": round_ms(median(p.step_ms for p in members)),
                "busy_ms_median": round_ms(median(p.busy_ms for p in members)),
                "worst_rank": {
                    "global_rank": worst.global_rank,
                    "step_ms_median": round_ms(worst.step_ms),
                    "busy_ms_median": round_ms(worst.busy_ms),
                },
            }
        )
    return out


def skews(run: RunData, policy: Policy | None = None) -> dict[str, Any]:
    """Global skew (slowest vs fastest rank median step) and node skew (slowest vs
    fastest node median), in ms and % of the fastest; busy skew shows what DDP hides."""
    profs = _profiles(run, policy)
    out: dict[str, Any] = {
        "global_skew_ms": None,
        "global_skew_pct": None,
        "busy_skew_ms": None,
        "slowest_rank": None,
        "fastest_rank": None,
        "node_skew_ms": None,
        "node_skew_pct": None,
        "node_busy_skew_ms": None,
        "slowest_node": None,
        "fastest_node": None,
    }
    if not profs:
        return out
    slow = max(profs, key=lambda p: p.step_ms or 0.0)
    fast = min(profs, key=lambda p: p.step_ms or 0.0)
    out["global_skew_ms"] = round_ms((slow.step_ms or 0.0) - (fast.step_ms or 0.0))
    out["global_skew_pct"] = _pct(slow.step_ms, fast.step_ms)
    busy = [p.busy_ms for p in profs if p.busy_ms is not None]
    busiest = max(profs, key=lambda p: p.busy_ms or 0.0)
    out["busy_skew_ms"] = round_ms(max(busy) - min(busy)) if busy else None
    out["slowest_rank"] = busiest.global_rank if busy else slow.global_rank
    out["fastest_rank"] = min(profs, key=lambda p: p.busy_ms or 0.0).global_rank if busy else fast.global_rank
    views = node_views(run, policy)
    if len(views) >= 2:
        # Busy time breaks ties: under DDP every node reports the same step time.
        def key(v: dict[str, Any]) -> tuple[float, float]:
            return (v["step_ms_median"] or 0.0, v["busy_ms_median"] or 0.0)

        slow_n, fast_n = max(views, key=key), min(views, key=key)
        out["node_skew_ms"] = round_ms((slow_n["step_ms_median"] or 0.0) - (fast_n["step_ms_median"] or 0.0))
        out["node_skew_pct"] = _pct(slow_n["step_ms_median"], fast_n["step_ms_median"])
        busy_n = [v["busy_ms_median"] for v in views if v["busy_ms_median"] is not None]
        out["node_busy_skew_ms"] = round_ms(max(busy_n) - min(busy_n)) if busy_n else None
        out["slowest_node"] = slow_n["node_rank"]
        out["fastest_node"] = fast_n["node_rank"]
    return out


def _pct(slow: float | None, fast: float | None) -> float | None:
    if slow is None or not fast:
        return None
    return round(100.0 * (slow - fast) / fast, 2)
