"""An agent batch body: its tables and, beside its steps, their history partials."""

from __future__ import annotations

from typing import Any

import msgpack

from traceml_wire.partials import encode_partials


def encode_body(tables: dict[str, dict[str, list[Any]]], **extra: Any) -> bytes:
    """Pack an agent batch body: ``{"tables": {...}, **extra}``, plus the history
    partials of its steps where there are enough of them (``traceml_wire.partials``)."""
    body: dict[str, Any] = {"tables": {k: v for k, v in tables.items() if v and any(v.values())}}
    steps = tables.get("steps")
    if steps:
        partials = encode_partials(steps)
        if partials is not None:
            body["history"] = partials
    body.update(extra)
    return msgpack.packb(body, use_bin_type=True)
