"""LOSS_NONFINITE: the first step and rank where a logged scalar became NaN or infinite."""

from __future__ import annotations

import math

from tests.traceml_daemon.analysis.synth import make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import NonFinite


def test_first_rank_and_step_are_named_and_the_followers_listed() -> None:
    run = make_run([make_rank(r) for r in range(3)])
    run.nonfinite = [
        NonFinite(global_rank=2, name="loss", step=31, value=math.nan),
        NonFinite(global_rank=1, name="loss", step=30, value=math.inf),
        NonFinite(global_rank=0, name="loss", step=31, value=math.nan),
    ]
    verdicts = diagnose(run)
    assert verdicts[0].name == "LOSS_NONFINITE"  # critical, and first: nothing after it means much
    (v,) = [v for v in verdicts if v.name == "LOSS_NONFINITE"]
    assert v.severity == "critical" and v.scope == {"global_rank": 1}
    assert v.evidence["step"] == 30 and v.evidence["value"] == "+inf" and v.evidence["scalar"] == "loss"
    assert [r["global_rank"] for r in v.evidence["ranks_after"]] == [0, 2]
    assert "loss became +inf at step 30 on rank 1" in v.why


def test_one_verdict_per_scalar_and_none_when_all_finite() -> None:
    run = make_run([make_rank(0)])
    assert not [v for v in diagnose(run) if v.name == "LOSS_NONFINITE"]
    run.nonfinite = [NonFinite(0, "loss", 5, math.nan), NonFinite(0, "grad_norm", 4, -math.inf)]
    names = sorted(v.evidence["scalar"] for v in diagnose(run) if v.name == "LOSS_NONFINITE")
    assert names == ["grad_norm", "loss"]
