"""Numerics gone wrong: a logged scalar (the loss, a grad norm) became NaN or infinite.

Everything after that step trains on garbage, so the verdict names the first
step and the rank that got there first; the other ranks that followed are
listed in the evidence, because under DDP one rank's NaN reaches every rank
through the all-reduce within a step.
"""

from __future__ import annotations

import math

from traceml_daemon.analysis.model import NonFinite, Verdict
from traceml_daemon.analysis.policy import NumericsPolicy


def nonfinite_text(value: float) -> str:
    """How a non-finite value is written in evidence and JSON output."""
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def nonfinite_verdicts(found: list[NonFinite], policy: NumericsPolicy) -> list[Verdict]:
    """One LOSS_NONFINITE verdict per scalar name, scoped to the first rank that logged it non-finite."""
    by_name: dict[str, list[NonFinite]] = {}
    for item in found:
        by_name.setdefault(item.name, []).append(item)
    out: list[Verdict] = []
    for name, items in sorted(by_name.items()):
        items.sort(key=lambda i: (i.step, i.global_rank))
        first = items[0]
        others = [{"global_rank": i.global_rank, "step": i.step, "value": nonfinite_text(i.value)} for i in items[1:]]
        out.append(
            Verdict(
                "LOSS_NONFINITE",
                "critical",
                {"global_rank": first.global_rank},
                f"{name} became {nonfinite_text(first.value)} at step {first.step} on rank {first.global_rank}"
                + (f", then on {len(others)} more rank(s)" if others else ""),
                {
                    "scalar": name,
                    "step": first.step,
                    "value": nonfinite_text(first.value),
                    "ranks_after": others[: policy.max_ranks_listed],
                    "ranks_after_total": len(others),
                },
                "Look at the steps just before it: the learning rate (warmup, scheduler), the gradient norm, "
                "mixed-precision loss scaling and the batch that step read; rerun from the last checkpoint with "
                "anomaly detection (torch.autograd.set_detect_anomaly) around that step.",
            )
        )
    return out
