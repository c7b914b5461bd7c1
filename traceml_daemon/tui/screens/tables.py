"""Tables of the TUI's screens: filling a DataTable cheaply, paging a long one,
and the rank table's cells.

Every string cell goes in as plain Text (``widgets.plain``): a DataTable reads a
str cell as markup, so a hostname like ``[/]`` would end the app.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textual.widgets import DataTable

from traceml_daemon.analysis.model import PHASES
from traceml_daemon.tui.model import RankRow
from traceml_daemon.tui.widgets import fmt_ms, plain

_PHASE_SHORT = {
    "dataloader": "data",
    "h2d": "h2d",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "wait": "wait",
}


def _cell(value: Any) -> Any:
    return plain(value) if isinstance(value, str) else value


def fill_table(table: DataTable[Any], rows: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
    """Show ``rows`` (key, cells) in ``table``, touching as little as possible.

    Adding rows makes DataTable measure every cell (about 0.4 s for 1024 ranks),
    so when the keys are unchanged, which is the normal case on a live run, only
    the cells whose text changed are updated in place. Otherwise the table is
    rebuilt and the cursor stays on the same key.
    """
    previous: list[tuple[str, tuple[Any, ...]]] | None = getattr(table, "_tui_rows", None)
    rows = list(rows)
    if previous is not None and [k for k, _ in previous] == [k for k, _ in rows]:
        columns = [c.key for c in table.ordered_columns]
        for (key, old), (_, new) in zip(previous, rows, strict=True):
            if old == new:
                continue
            for col, a, b in zip(columns, old, new, strict=True):
                if a != b:
                    # Re-measure the column only when the text got wider.
                    table.update_cell(key, col, _cell(b), update_width=len(str(b)) > len(str(a)))
        table._tui_rows = rows  # type: ignore[attr-defined]
        return
    current = None
    if table.row_count and 0 <= table.cursor_row < table.row_count:
        current = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    table.clear()
    for key, cells in rows:
        table.add_row(*map(_cell, cells), key=key)
    table._tui_rows = rows  # type: ignore[attr-defined]
    if current is not None:
        keys = [k for k, _ in rows]
        if current in keys:
            table.move_cursor(row=keys.index(current), animate=False)


class PagedTable(DataTable[Any]):
    """A DataTable holding one page of a longer row list.

    DataTable measures every cell of a new row (about 1.3 s for 4096 ranks) and
    each in-place update is Python work, so only ``page`` rows live in the
    widget. Moving the cursor past the page's edge (arrows, PgUp/PgDn,
    Ctrl+Home/End) loads the page around the target row; keys stay the
    caller's, so selection and jumps work as before.
    """

    def __init__(self, *, page: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.page_rows = max(2, page)
        self.first_row = 0  # index in ``all_rows`` of the table's first row
        self.all_rows: Sequence[Any] = []
        self._cells: Callable[[Any], tuple[str, tuple[Any, ...]]] = lambda row: row

    def set_rows(self, rows: Sequence[Any], cells: Callable[[Any], tuple[str, tuple[Any, ...]]] | None = None) -> None:
        """``rows``: items, turned into (key, cells) by ``cells`` for the shown page only
        (formatting 4096 rows of cells every refresh costs more than showing them)."""
        self.all_rows = rows
        if cells is not None:
            self._cells = cells
        self.first_row = max(0, min(self.first_row, len(self.all_rows) - self.page_rows))
        self._fill()

    def _fill(self) -> None:
        page = self.all_rows[self.first_row : self.first_row + self.page_rows]
        fill_table(self, [self._cells(row) for row in page])

    def _goto(self, index: int) -> bool:
        """Put the cursor on ``all_rows[index]``, loading its page; False when it is already loaded."""
        index = max(0, min(index, len(self.all_rows) - 1))
        if self.first_row <= index < self.first_row + self.row_count:
            return False
        self.first_row = max(0, min(index - self.page_rows // 2, len(self.all_rows) - self.page_rows))
        self._fill()
        self.move_cursor(row=index - self.first_row, animate=False)
        return True

    def _step(self, delta: int) -> bool:
        return self._goto(self.first_row + self.cursor_row + delta)

    def action_cursor_down(self) -> None:
        if not self._step(1):
            super().action_cursor_down()

    def action_cursor_up(self) -> None:
        if not self._step(-1):
            super().action_cursor_up()

    def action_page_down(self) -> None:
        if not self._step(max(1, self.scrollable_content_region.height - 1)):
            super().action_page_down()

    def action_page_up(self) -> None:
        if not self._step(-max(1, self.scrollable_content_region.height - 1)):
            super().action_page_up()

    def action_scroll_top(self) -> None:
        if not self._goto(0):
            super().action_scroll_top()

    def action_scroll_bottom(self) -> None:
        if not self._goto(len(self.all_rows) - 1):
            super().action_scroll_bottom()

    def window_label(self) -> str:
        """The " (rows a–b of n, ...)" suffix for the table's title when paged, else ""."""
        n = len(self.all_rows)
        if n <= self.page_rows:
            return ""
        return f" (rows {self.first_row + 1}–{self.first_row + self.row_count} of {n}, PgDn/PgUp)"


def rank_cells(r: RankRow, with_node: bool = True) -> tuple[Any, ...]:
    cells: list[Any] = [f"r{r.global_rank}"]
    if with_node:
        cells.append(f"n{r.node_rank}")
    cells += [str(r.steps), fmt_ms(r.step_ms)]
    cells += [fmt_ms(r.phase_ms.get(p)) for p in PHASES]
    return tuple(cells)


def rank_columns(with_node: bool = True) -> list[str]:
    return ["rank"] + (["node"] if with_node else []) + ["steps", "step ms"] + [_PHASE_SHORT[p] for p in PHASES]

