from __future__ import annotations

from traceml_wire.printable import printable, printable_text


def test_every_control_character_is_escaped_in_one_line() -> None:
    assert printable("a\x1b[31mb\nc\x9bd\x7f") == "a\\x1b[31mb\\x0ac\\x9bd\\x7f"
    assert printable("x" * 300, limit=10) == "xxxxxxx..."
    assert printable(None) == "None"


def test_text_keeps_newlines_and_tabs_only() -> None:
    assert printable_text("a\tb\nc\x1b]0;title\x07") == "a\tb\nc\\x1b]0;title\\x07"
    assert printable_text("ünïcode [/] ok") == "ünïcode [/] ok"
