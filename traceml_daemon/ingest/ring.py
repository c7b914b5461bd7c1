"""``Ring`` moved to ``traceml_daemon.analysis.ring``: it is pure, and the rolling
windows built on it (``analysis.rolling``) serve the TUI as well as the writer."""

from traceml_daemon.analysis.ring import Ring

__all__ = ["Ring"]
