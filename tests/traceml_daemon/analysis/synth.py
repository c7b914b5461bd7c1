"""Synthetic RunData builders for the analysis tests (times given in ms)."""

from __future__ import annotations

from traceml_daemon.analysis.model import PHASES, RankData, RankStatus, RunData

MS = 1_000_000

BASE = {"dataloader": 5.0, "h2d": 1.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "wait": 4.0}


def make_rank(
    global_rank: int,
    n: int = 40,
    node_rank: int | None = None,
    step_ms: float | None = None,
    rss: list[int] | None = None,
    peak: list[int] | None = None,
    status: RankStatus | None = None,
    t0: float = 1000.0,
    **phase_ms: float | None,
) -> RankData:
    """A rank with ``n`` steps; phases default to BASE, the step to their sum.

    A small deterministic jitter (0-0.2 ms) keeps medians honest without noise."""
    phases = dict(BASE)
    phases.update(phase_ms)
    r = RankData(global_rank=global_rank, local_rank=global_rank, node_rank=node_rank, hostname=f"h{node_rank}")
    t = t0
    for i in range(n):
        jitter = (i % 3) * 0.1
        values = {
            p: (None if v is None else int((v + (jitter if p == "forward" and v else 0.0)) * MS))
            for p, v in phases.items()
        }
        total = step_ms if step_ms is not None else sum(v or 0.0 for v in phases.values())
        s = int((total + jitter) * MS)
        r.steps.append(i)
        r.step_ns.append(s)
        for p in PHASES:
            r.phases_ns.setdefault(p, []).append(values.get(p))
        t += s / 1e9
        r.step_ts.append(t)
        r.rss_bytes.append(rss[i] if rss else 1 << 30)
        r.peak_bytes.append(peak[i] if peak else None)
    r.status = status
    return r


def make_run(ranks: list[RankData], parallelism: str = "ddp", **kw: object) -> RunData:
    return RunData(ranks=ranks, parallelism=parallelism, **kw)  # type: ignore[arg-type]
