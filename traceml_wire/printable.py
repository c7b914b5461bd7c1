"""Untrusted strings made safe to print on a terminal or in a log line.

Hostnames, session ids, sender ids and layer names come from peers; written
raw, an escape sequence among them would drive the reader's terminal.
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls; newline and tab are kept only where a caller allows it.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def printable(value: object, limit: int = 256) -> str:
    """One line: every control character (newline included) escaped, at most ``limit`` characters."""
    text = _CONTROL_ALL.sub(_escape, str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable_text(text: str) -> str:
    """A multi-line text: newlines and tabs kept, every other control character escaped."""
    return _CONTROL.sub(_escape, text)
