"""The TUI's screens. None touches the database: the app's refresh worker reads a
``Snapshot`` off the UI thread and hands it to the active screen's ``show``.

* ``overview``: the run at a glance, the screen the app opens on;
* ``detail``: one node, one rank;
* ``findings``: verdicts and delivery counters;
* ``prompts``: help and the jump prompt;
* ``runs``: the run picker;
* ``inspect``: the step inspector (every rank at one step); ``logs``: the ranks' output, folded;
* ``tables``: DataTable filling and paging the screens share.
"""

from traceml_daemon.tui.model import Snapshot
from traceml_daemon.tui.screens.detail import NodeScreen, RankScreen
from traceml_daemon.tui.screens.findings import VerdictsScreen, delivery_text, verdict_text
from traceml_daemon.tui.screens.inspect import StepScreen
from traceml_daemon.tui.screens.logs import LogsScreen
from traceml_daemon.tui.screens.overview import OverviewScreen
from traceml_daemon.tui.screens.prompts import HelpScreen, JumpScreen
from traceml_daemon.tui.screens.runs import Pick, RunsScreen
from traceml_daemon.tui.screens.tables import PagedTable, fill_table

__all__ = [
    "HelpScreen", "JumpScreen", "LogsScreen", "NodeScreen", "OverviewScreen", "PagedTable", "Pick", "RankScreen",
    "RunsScreen", "Snapshot", "StepScreen", "VerdictsScreen", "delivery_text", "fill_table", "verdict_text",
]
