"""The rank screen's FSDP2 shard view: mesh, shard and full size, per-step memory and
the time waiting in FSDP2's collectives, read from the database (synthetic FSDP2 run)."""

from __future__ import annotations

import sqlite3

from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle, static_text
from traceml_daemon.tui.screens import RankScreen


def _with_wait(db: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE steps SET fwd_comm_ns = 3000000, bwd_comm_ns = 12500000, replicate_comm_ns = 4000000")
        conn.execute("UPDATE models SET shard_degree = 2, replicate_degree = 2")


@asynctest
async def test_rank_screen_shows_the_shard_view_with_collective_wait(tui_db: str) -> None:
    _with_wait(tui_db)
    app = make_app(tui_db)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("tab")
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen)
        text = static_text(app.screen, "#shard")
        assert "FSDP2 shard view" in text and "mesh 2 replicas x 2 shards" in text, text
        assert "forward 3.0 " in text and "backward 12.5 " in text and "replicate all-reduce 4.0)" in text, text
        assert "shard 1.8 GiB" in text, text


@asynctest
async def test_the_shard_view_is_hidden_without_an_fsdp2_model(tui_db: str) -> None:
    with sqlite3.connect(tui_db) as conn:
        conn.execute("UPDATE models SET parallelism = 'ddp', local_shard_bytes = NULL, estimated_full_bytes = NULL")
    app = make_app(tui_db)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("tab")
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen)
        assert not app.screen.query_one("#shard").display
