"""Verdict ordering and the plain-text rendering the final summary prints."""

from __future__ import annotations

from typing import Any

from traceml_daemon.analysis.model import Verdict

_SEVERITY_RANK = {"critical": 0, "warn": 1, "info": 2}

# Within one severity: what blocks the run first, then what explains the most time.
PRIORITY = (
    "LOSS_NONFINITE",
    "GRAD_NONFINITE",
    "REPLICA_DIVERGED",
    "HANG",
    "RANK_STALLED",
    "NODE_STRAGGLER",
    "COMPUTE_STRAGGLER",
    "INPUT_STRAGGLER",
    "H2D_STRAGGLER",
    "WAIT_STRAGGLER",
    "STRAGGLER",
    "INPUT_BOUND",
    "H2D_BOUND",
    "WAIT_HEAVY",
    "HIGH_PRESSURE",
    "CREEP_CONFIRMED",
    "HOST_MEM_SATURATED",
    "IMBALANCE",
    "HOST_CPU_SATURATED",
    "GPU_HOT",
    "LOW_GPU_UTIL",
    "CREEP_EARLY",
    "INCOMPLETE_DATA",
    "WARMUP",
    "COMPUTE_BOUND",
)
_PRIORITY_RANK = {name: i for i, name in enumerate(PRIORITY)}


def sort_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    """Primary first: severity, then PRIORITY; stable, so domains keep their own order (worst first)."""
    return sorted(
        verdicts,
        key=lambda v: (_SEVERITY_RANK.get(v.severity, 3), _PRIORITY_RANK.get(v.name, len(PRIORITY))),
    )


def scope_text(scope: dict[str, int]) -> str:
    if "global_rank" in scope:
        node = f", node {scope['node_rank']}" if "node_rank" in scope else ""
        return f"rank {scope['global_rank']}{node}"
    if "node_rank" in scope:
        return f"node {scope['node_rank']}"
    return "run"


def _value(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def format_verdict(v: Verdict, indent: str = "  ") -> str:
    lines = [f"[{v.severity.upper()}] {v.name} ({scope_text(v.scope)})", f"{indent}why:  {v.why}"]
    if v.next_step:
        lines.append(f"{indent}next: {v.next_step}")
    if v.evidence:
        lines.append(
            f"{indent}evidence: " + ", ".join(f"{k}={_value(x)}" for k, x in v.evidence.items() if x is not None)
        )
    return "\n".join(lines)


def format_verdicts(verdicts: list[Verdict]) -> str:
    """Primary verdict first with why, what to try next and evidence; the rest below it."""
    if not verdicts:
        return "Diagnosis: no findings."
    ordered = sort_verdicts(verdicts)
    parts = ["Diagnosis: " + format_verdict(ordered[0])]
    if len(ordered) > 1:
        parts.append("Also:")
        parts.extend("  " + format_verdict(v, "    ") for v in ordered[1:])
    return "\n".join(parts)
