"""A GPU run's steps timed on the host only (device_timed 0: phases and wait empty) keep
their length in the step median and stay out of the phase and busy medians."""

from __future__ import annotations

from typing import Any

from traceml_daemon.analysis.rolling import RankWindow

MS = 1_000_000


def _rows(n: int, device_timed: bool) -> dict[str, list[Any]]:
    timed = [v if device_timed else None for v in (4 * MS, 5 * MS, 2 * MS)]
    return {
        "step": list(range(n)),
        "ts": [1.0 + i for i in range(n)],
        "step_ns": [12 * MS] * n,
        "dataloader_ns": [1 * MS] * n,
        "forward_ns": [timed[0]] * n,
        "backward_ns": [timed[1]] * n,
        "optimizer_ns": [timed[2]] * n,
        "wait_ns": [(3 * MS) if device_timed else None] * n,
        "comm_ns": [(2 * MS) if device_timed else None] * n,
        "device_timed": [1 if device_timed else 0] * n,
    }


def test_host_only_steps_count_in_the_step_median_and_nowhere_else() -> None:
    window = RankWindow(rank_id=1, global_rank=0)
    window.add(_rows(2, device_timed=True))
    window.add(_rows(7, device_timed=False))  # most steps: host only
    step, phases, busy = window.medians()
    assert step == 12.0
    assert phases["forward"] == 4.0 and phases["backward"] == 5.0 and phases["optimizer"] == 2.0
    assert phases["wait"] == 3.0
    assert busy == 9.0  # step less wait, from the device-timed steps only (not 12: no wait known)
