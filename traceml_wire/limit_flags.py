"""The command-line flags of a server's connection limits, declared once for
``traceml-relay`` and ``traceml-daemon serve`` (each with its own defaults)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from traceml_wire.limits import ConnectionLimits

# (ConnectionLimits field, what it bounds); the flag is the field with dashes.
FLAGS: tuple[tuple[str, str], ...] = (
    ("max_connections", "authenticated peers at once before refusing"),
    ("max_unauthenticated", "peers in their TLS handshake or before their hello is accepted; "
                            "when full, the oldest gives its slot to a newcomer"),
    ("max_unauthenticated_per_address", "of those, from one source address"),
    ("hello_timeout", "seconds a new peer has to authenticate"),
    ("read_timeout", "seconds a frame's body has to arrive once it is read"),
    ("idle_timeout", "seconds an authenticated peer may stay silent before it is closed"),
    ("inbound_bytes", "bytes of frames being read, all connections together, before reads pause"),
)


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be {'at least 1' if kind is int else 'above 0'}")
        return value

    return parse


def add_limit_arguments(parser: argparse.ArgumentParser, defaults: ConnectionLimits) -> None:
    """One flag per field of FLAGS, defaulting to ``defaults``."""
    for name, text in FLAGS:
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=_positive(type(value)), default=value,
                            help=f"{text} (default {value:g})")


def limits_from_args(defaults: ConnectionLimits, args: argparse.Namespace) -> ConnectionLimits:
    """``defaults`` with the flags' values."""
    return dataclasses.replace(defaults, **{name: getattr(args, name) for name, _ in FLAGS})
