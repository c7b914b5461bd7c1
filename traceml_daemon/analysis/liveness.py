"""Live checks: a rank that stops completing steps (RANK_STALLED) or a run that hangs (HANG).

Only for a run in progress (``run.live`` and ``run.now``). A rank is stalled
when it has sat in one phase, or has not reported, for longer than the policy
allows (at least ``stall_step_factor`` median steps, so slow steps are not
stalls). In a synchronized run the stuck rank is the one NOT in the wait
phase: the others wait for it in the collective, and the verdict names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceml_daemon.analysis.model import RankData, RunData, Verdict
from traceml_daemon.analysis.policy import LivenessPolicy
from traceml_daemon.analysis.stats import median, rank_ranges


@dataclass
class Stall:
    rank: int
    node_rank: int | None
    phase: str
    seconds: float  # in this phase (or silent) for this long
    silent: bool  # no report for that long: the phase is only the last known one
    step: int | None


def _where(rank: int, node_rank: int | None) -> str:
    return f"rank {rank}" + (f" (node {node_rank})" if node_rank is not None else "")


def _stall_of(rank: RankData, now: float, limit: float) -> Stall | None:
    st = rank.status
    if st is not None:
        if st.finished:
            return None
        silent_s = max(0.0, now - st.ts)
        in_phase = max(0.0, now - st.phase_since)
        if silent_s >= limit:
            return Stall(rank.global_rank, rank.node_rank, st.phase, silent_s, True, st.step)
        if in_phase >= limit:
            return Stall(rank.global_rank, rank.node_rank, st.phase, in_phase, False, st.step)
        return None
    last = next((t for t in reversed(rank.step_ts) if t is not None), None)
    if last is not None and now - last >= limit:
        step = rank.steps[-1] if rank.steps else None
        return Stall(rank.global_rank, rank.node_rank, "unknown", now - last, True, step)
    return None


def _describe(s: Stall) -> str:
    if s.silent:
        last = f" (last seen in {s.phase})" if s.phase != "unknown" else ""
        return f"{_where(s.rank, s.node_rank)} has not reported for {s.seconds:.0f} s{last}"
    where = "outside a training step" if s.phase == "idle" else f"in {s.phase}"
    return f"{_where(s.rank, s.node_rank)} has been {where} for {s.seconds:.0f} s"


def _evidence(s: Stall, limit: float) -> dict[str, object]:
    return {
        "phase": s.phase,
        "seconds": round(s.seconds, 1),
        "silent": s.silent,
        "step": s.step,
        "limit_s": round(limit, 1),
    }


def liveness_verdicts(run: RunData, policy: LivenessPolicy) -> list[Verdict]:
    if not run.live or run.now is None:
        return []
    now = run.now
    step_s = median(v for r in run.ranks for v in r.step_ns[-policy.step_median_window :])
    limit = max(policy.stall_s, policy.stall_step_factor * (step_s or 0.0) / 1e9)
    running = [r for r in run.ranks if not (r.status is not None and r.status.finished)]
    stalls = [s for r in running if (s := _stall_of(r, now, limit)) is not None]
    if not stalls:
        return []
    culprits = sorted((s for s in stalls if s.phase != "wait" or s.silent), key=lambda s: -s.seconds)
    waiters = [s for s in stalls if s.phase == "wait" and not s.silent]
    progressing = len(running) - len(stalls)
    collective = "the all-reduce" if run.parallelism == "ddp" else "a collective"
    out: list[Verdict] = []
    if progressing == 0 and not waiters and all(s.phase == "idle" and not s.silent for s in culprits):
        # Every rank is alive but outside trace_step: evaluation, checkpointing or the end of
        # training, not a hang. Say so quietly.
        longest = culprits[0]
        return [
            Verdict(
                "RANK_STALLED",
                "info",
                {},
                f"ranks {rank_ranges(s.rank for s in culprits)} have been outside a training step for "
                f"{longest.seconds:.0f} s (evaluation, checkpointing, or training is over without agent.shutdown())",
                {"phase": "idle", "seconds": round(longest.seconds, 1), "limit_s": round(limit, 1)},
                "Nothing to do if this is expected; wrap long non-step work in agent.span() to see it in the trace.",
            )
        ]
    if culprits and (waiters or progressing == 0):
        head = culprits[0]
        why = _describe(head)
        if waiters:
            why += f"; ranks {rank_ranges(s.rank for s in waiters)} wait in {collective}"
        ev = _evidence(head, limit)
        ev.update(
            {
                "waiting_ranks": rank_ranges(s.rank for s in waiters),
                "stalled_ranks": rank_ranges(s.rank for s in culprits),
            }
        )
        scope = {"global_rank": head.rank} | ({"node_rank": head.node_rank} if head.node_rank is not None else {})
        out.append(
            Verdict(
                "HANG",
                "critical",
                scope,
                why,
                ev,
                f"Dump the stack of rank {head.rank}: py-spy dump --pid <pid> (add --native for NCCL), or "
                "TORCH_NCCL_TRACE_BUFFER_SIZE / the NCCL flight recorder; check that rank's node for a dead "
                "GPU (Xid errors in dmesg), a stuck DataLoader worker or a data-dependent branch skipping a collective.",
            )
        )
        rest = culprits[1:]
    elif culprits:
        rest = culprits
    else:
        # Everyone stuck is waiting and nobody computes: the missing peer died or left the group.
        if progressing == 0:
            longest = max(waiters, key=lambda s: s.seconds)
            out.append(
                Verdict(
                    "HANG",
                    "critical",
                    {},
                    f"ranks {rank_ranges(s.rank for s in waiters)} have waited in {collective} for up to "
                    f"{longest.seconds:.0f} s and no rank is computing: a peer may have died or left the group",
                    {
                        "waiting_ranks": rank_ranges(s.rank for s in waiters),
                        "seconds": round(longest.seconds, 1),
                        "limit_s": round(limit, 1),
                    },
                    "Look for a crashed rank (its log, dmesg for OOM kills or Xid errors) and for ranks that took a "
                    "different code path (a collective called a different number of times).",
                )
            )
            return out
        rest = waiters
    for s in rest[: policy.max_rank_verdicts]:
        scope = {"global_rank": s.rank} | ({"node_rank": s.node_rank} if s.node_rank is not None else {})
        out.append(
            Verdict(
                "RANK_STALLED",
                "warn",
                scope,
                _describe(s) + " without completing a step",
                _evidence(s, limit),
                f"Dump the stack of rank {s.rank} with py-spy dump --pid <pid>; check its DataLoader workers "
                "and its node's health.",
            )
        )
    return out
