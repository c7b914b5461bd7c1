"""One bad peer never takes the TUI down: names a peer sent are shown as they are.

A hostname, a layer name and a session id reach the screen through table cells
and text; each must be plain text there, never Rich markup (``[/]`` would end
the app with a MarkupError) and never a terminal control sequence.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from textual.widgets import DataTable, Input

from tests.support.synth_db import SynthSpec, build
from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle, static_text
from traceml_daemon.tui.screens import NodeScreen, OverviewScreen, RankScreen
from traceml_daemon.tui.widgets import plain

HOST = "[/]"
LAYER = "[bold]x[/"
SESSION = "run-\x1b[31m-red"
SESSION_SHOWN = "run-\\x1b[31m-red"  # the escape written out, not sent to the terminal


def _hostile_db(tmp_path: Path) -> str:
    db = build(str(tmp_path / "hostile.db"), SynthSpec(session=SESSION))
    rw = sqlite3.connect(db)
    rw.execute("UPDATE ranks SET hostname=?", (HOST,))
    (layer,) = rw.execute("SELECT layer FROM layers ORDER BY rowid LIMIT 1").fetchone()
    rw.execute("UPDATE layers SET layer=? WHERE layer=?", (LAYER, layer))
    rw.commit()
    rw.close()
    return db


def _cells(table: DataTable[object]) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


@asynctest
async def test_markup_and_escape_sequences_from_peers_render_literally(tmp_path: Path) -> None:
    app = make_app(_hostile_db(tmp_path))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, OverviewScreen) and app.last_error is None
        header = static_text(app.screen, "#header")
        assert SESSION_SHOWN in header and "\x1b" not in header
        nodes = app.screen.query_one("#nodes", DataTable)
        assert [row[1] for row in _cells(nodes)] == [HOST, HOST]
        await pilot.pause()  # a frame is drawn with the cells in it

        await press(pilot, "enter")  # the first node
        assert isinstance(app.screen, NodeScreen) and app.last_error is None
        assert f"  {HOST}  " in static_text(app.screen, "#title")

        await pilot.press("slash")  # rank 0 has the deep-dive layers
        app.screen.query_one(Input).value = "r0"
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen) and app.last_error is None
        assert f"  {HOST}  " in static_text(app.screen, "#title")
        layers = app.screen.query_one("#layers", DataTable)
        assert LAYER in [row[0] for row in _cells(layers)]
        # What was drawn: the screen's own render of the layer table holds the name as typed.
        assert LAYER in "".join(seg.text for line in layers.render_lines(layers.region.reset_offset) for seg in line)

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


def test_plain_text_is_never_markup() -> None:
    for name in (HOST, LAYER, ":smile:", "a\\"):
        assert plain(name).plain == name and not plain(name).spans
    assert plain(SESSION).plain == SESSION_SHOWN
    assert plain("tab\there\n").plain == "tab\\x09here\\x0a"
