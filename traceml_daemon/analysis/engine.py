"""The analysis engine: one entry point from run data to sorted verdicts.

Used by the live TUI, the final summary and compare, so the order of checks
and the suppression rules live here and nowhere else. Stdlib only, no I/O.
"""

from __future__ import annotations

from traceml_daemon.analysis.fingerprints import nonfinite_grad_verdicts, replica_verdicts
from traceml_daemon.analysis.liveness import liveness_verdicts
from traceml_daemon.analysis.memory import memory_verdicts
from traceml_daemon.analysis.model import RunData, Verdict
from traceml_daemon.analysis.numerics import nonfinite_verdicts
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy
from traceml_daemon.analysis.report import format_verdicts, sort_verdicts
from traceml_daemon.analysis.steps import bound_verdicts, check_data
from traceml_daemon.analysis.stragglers import node_excesses, node_verdicts, rank_excesses, rank_verdicts
from traceml_daemon.analysis.system import system_verdicts
from traceml_daemon.analysis.window import collective_coupled, profiles

__all__ = ["diagnose", "format_verdicts", "sort_verdicts"]


def diagnose(run: RunData, policy: Policy | None = None) -> list[Verdict]:
    """All verdicts for ``run``, primary first. Abstains (INCOMPLETE_DATA, WARMUP)
    instead of guessing when the step data cannot support a verdict."""
    policy = policy or DEFAULT_POLICY
    sp = policy.steps
    profs = profiles(run, sp.warmup_steps, sp.window, sp.clock_slack_frac)
    check = check_data(run, profs, sp)
    out: list[Verdict] = list(check.verdicts)
    # Liveness and host/GPU samples do not need step history: a hang at step 3 still counts.
    out += liveness_verdicts(run, policy.liveness)
    out += system_verdicts(run.systems, policy.system)
    out += nonfinite_verdicts(run.nonfinite, policy.numerics)
    out += nonfinite_grad_verdicts(run.fingerprints, policy.numerics)
    out += replica_verdicts(run.fingerprints, run.parallelism, policy.numerics)
    if check.enough_steps:
        eligible = [p for p in profs if p.n_window >= sp.min_steps]
        nodes = node_excesses(eligible, policy.stragglers)
        slow_nodes = {e.node_rank for e in nodes if e.node_rank is not None}
        stragglers = node_verdicts(nodes, policy.stragglers, check.phases_ok)
        stragglers += rank_verdicts(
            rank_excesses(eligible, policy.stragglers, coupled=collective_coupled(run)),
            policy.stragglers,
            check.phases_ok,
            slow_nodes,
        )
        out += stragglers
        if check.phases_ok:
            bounds = bound_verdicts(eligible, sp)
            if stragglers:
                # The others' wait is the straggler's doing; WAIT_HEAVY would blame the network.
                bounds = [v for v in bounds if v.name != "WAIT_HEAVY"]
            out += bounds
        out += memory_verdicts(run, policy.memory, sp.warmup_steps, sp.window)
    if any(v.severity != "info" for v in out):
        # "healthy" must not sit beside a real problem.
        out = [v for v in out if v.name != "COMPUTE_BOUND"]
    return sort_verdicts(out)
