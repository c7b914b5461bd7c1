"""The JSON the commands print and write: strict (RFC 8259), so that any parser reads it.

A stored value may be NaN or infinite (a NaN loss, a peer's ``ts`` of inf, stored as
such). Such values go out as the strings verdict evidence uses ("NaN", "+inf", "-inf"),
never as the bare tokens Python's json module writes by default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import IO, Any

from traceml_daemon.analysis.numerics import nonfinite_text


def strict(value: Any, replace: Callable[[float], Any] = nonfinite_text) -> Any:
    """``value`` with every non-finite float replaced by ``replace(it)`` (its text by default)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else replace(value)
    if isinstance(value, dict):
        return {k: strict(v, replace) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v, replace) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def dump(value: Any, fh: IO[str], **kwargs: Any) -> None:
    fh.write(dumps(value, **kwargs))
