"""Findings and delivery: the verdicts screen and the text blocks it shares with the overview."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.tui.model import Delivery, Snapshot
from traceml_daemon.tui.widgets import clean

_SEV_STYLE = {"critical": "bold white on #c62828", "warn": "bold black on #f9a825", "info": "bold white on #1565c0"}


def verdict_text(v: Verdict, evidence: bool = False) -> Text:
    text = Text()
    text.append(f" {v.severity.upper()} ", style=_SEV_STYLE.get(v.severity, "bold"))
    scope = ", ".join(
        f"{k.replace('global_rank', 'rank').replace('node_rank', 'node')} {val}" for k, val in v.scope.items()
    )
    # Verdicts quote what peers sent (hostnames, names): written out, never interpreted.
    text.append(clean(f" {v.name}" + (f" [{scope}]" if scope else " [run]")), style="bold")
    text.append("\n" + clean(v.why))
    if evidence:
        for key, val in v.evidence.items():
            text.append(f"\n  {clean(key)}: ", style="dim")
            text.append(clean(str(val)))
        if v.next_step:
            text.append("\n  next: ", style="dim")
            text.append(clean(v.next_step))
    return text



class VerdictsScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static("Findings", classes="section")
            yield Static("", id="verdicts")
            yield Static("Delivery", classes="section")
            yield Static("", id="delivery")
        yield Footer()

    def show(self, snap: Snapshot) -> None:
        ov = snap.overview
        text = Text()
        if not ov.verdicts_available:
            text.append("analysis engine not available", style="dim")
        elif not ov.verdicts:
            text.append("no findings", style="green")
        for i, v in enumerate(ov.verdicts):
            if i:
                text.append("\n\n")
            text.append_text(verdict_text(v, evidence=True))
        self.query_one("#verdicts", Static).update(text)
        self.query_one("#delivery", Static).update(delivery_text(ov.header.delivery))


def delivery_text(d: Delivery) -> Text:
    """The delivery panel: what was lost (rows and batches apart), then every counter.

    Agent and relay counters arrive summed over senders (``delivery_counters``),
    so the panel is a few lines at 4096 ranks, not one per sender.
    """
    dt = Text()
    dt.append(
        f"rows dropped {d.rows_dropped}  batches dropped {d.batches_dropped}  spooled {d.spooled}\n",
        style="bold red" if d.lost else "bold",
    )
    groups: dict[str, list[str]] = {"daemon": [], "agents": [], "relays": []}
    for name, value in sorted(d.counters.items()):
        if name.startswith("agent_"):
            groups["agents"].append(f"{name.removeprefix('agent_')} {value}")
        elif name.startswith("relay_"):
            groups["relays"].append(f"{name.removeprefix('relay_')} {value}")
        elif not name.endswith("_reported"):  # the two totals are the line above
            groups["daemon"].append(f"{name} {value}")
    for label, items in groups.items():
        if items:
            dt.append(f"{label}: ", style="dim")
            dt.append(clean("  ".join(items)) + "\n")
    return dt

