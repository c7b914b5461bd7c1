"""The Rollouts screen (key ``o``): an RL job's rollout sessions, live.

Sessions per second, statuses, p50/p95/p99 per phase, the oldest sessions still
pending with their age, rejection reasons, the trainer's wait for rollouts and
the rollout verdicts, as ``traceml-daemon sessions`` prints them. It reads in a
worker of its own (``tui/rollouts.py``), on opening and then every ``reload_s``."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.tui.rollouts import NEWEST_SESSIONS, read_rollouts
from traceml_daemon.tui.screens.reloading import ReloadingScreen
from traceml_daemon.tui.widgets import clean

_SEVERITY = {"critical": "bold red", "warn": "yellow", "info": "cyan"}


class RolloutsScreen(ReloadingScreen):
    BODY_ID = "rollouts"

    def __init__(self, db_path: str, run: RunRef, reload_s: float = 2.0) -> None:
        super().__init__(db_path, run, reload_s)
        self.summary: dict[str, Any] | None = None  # the last summary read (tests look at it)

    def heading(self) -> str:
        return f"Rollouts of session {self.run.session}"

    def read(self) -> tuple[str | None, Text]:
        summary = read_rollouts(self.db_path, self.run)
        body = render(summary)
        self.summary = summary
        return None, body


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render(s: dict[str, Any]) -> Text:
    out = Text()
    if not s["sessions"]:
        out.append("no rollout sessions stored (the job does not use agent.session_context)", style="dim")
        return out
    rate = s["sessions_per_s"]
    out.append(f"sessions {s['sessions']:,}  finalized {s['finalized']:,}  pending {s['pending']:,}", style="bold")
    out.append(f"   {rate:.1f}/s" if rate else "")
    out.append(f"   (each rank's newest {NEWEST_SESSIONS:,})\n", style="dim")
    out.append("status   " + "  ".join(f"{k} {v:,}" for k, v in s["statuses"].items()) + "\n")
    trainer = s.get("trainer") or {}
    if trainer.get("steps"):
        whole = trainer["step_s"] + trainer["waiting_for_rollouts_s"]
        share = trainer["waiting_for_rollouts_s"] / whole if whole else 0.0
        out.append(f"trainer  {trainer['steps']:,} steps, waiting for rollouts {share:.0%} of its time\n")
    out.append(f"\n{'phase':<16}{'n':>8}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}\n", style="bold")
    for phase, d in s["phases"].items():
        out.append(clean(f"{phase[:15]:<16}{d['n']:>8}{_ms(d['p50_s']):>10}{_ms(d['p95_s']):>10}"
                         f"{_ms(d['p99_s']):>10}{_ms(d['max_s']):>10}") + "\n")
    if s["reasons"]:
        out.append("\nreasons  ", style="bold")
        out.append(clean(", ".join(f"{k} ({v:,})" for k, v in s["reasons"].items())) + "\n")
    if s["oldest_pending"]:
        out.append("\noldest pending\n", style="bold")
        for p in s["oldest_pending"]:
            age = "-" if p["age_s"] is None else f"{p['age_s']:.1f} s"
            out.append(clean(f"  rank {p['rank']} task {p['task_id']} session {p['session_id']}: {age}") + "\n")
    if s["verdicts"]:
        out.append("\n")
        for v in s["verdicts"]:
            out.append(f"{v['name']} ", style=_SEVERITY.get(v["severity"], ""))
            out.append(clean(v["why"]) + "\n")
    return out
