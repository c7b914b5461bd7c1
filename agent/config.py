"""Agent settings from the environment, with ``agent.init(**overrides)`` on top.

Parsing never raises: a malformed value falls back to its default and the
problem is returned as a message, because a typo in an environment variable
must not stop a training job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_DAEMON = ("127.0.0.1", 29765)
DEFAULT_RELAY_PORT = 29766
DEFAULT_FLUSH_S = 1.0
DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_RECORDER_BYTES = 32 * 1024 * 1024
DEFAULT_DEEP_DIVE_EVERY = 50
DEFAULT_FINGERPRINT_EVERY = 200  # the interval fingerprint_every=True (or "on") picks

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Config:
    disabled: bool = False
    daemon: tuple[str, int] = DEFAULT_DAEMON  # where the relay forwards
    token: str | None = field(default=None, repr=False)  # never printed
    tls_ca: str | None = None  # CA file: the node relay reaches the daemon over TLS, verified by it
    relay_host: str = "127.0.0.1"  # the agent always talks to its node's loopback relay
    relay_port: int = DEFAULT_RELAY_PORT
    flush_s: float = DEFAULT_FLUSH_S
    buffer_bytes: int = DEFAULT_BUFFER_BYTES  # unacknowledged batches kept for resend
    recorder_bytes: int = DEFAULT_RECORDER_BYTES  # rows waiting for the next flush
    deep_dive: bool = False
    deep_dive_every: int = DEFAULT_DEEP_DIVE_EVERY
    fingerprint_every: int = 0  # numerics fingerprints every N steps (agent/fingerprint.py); 0: off
    start_relay: bool = True  # local rank 0 starts the node relay in-process
    # How long shutdown (and exit) may take to hand the last rows to the daemon; what is
    # not acknowledged by then stays in the relay's spool (traceml-daemon ingest).
    shutdown_timeout_s: float = 2.0
    capture_output: bool = True  # tee the rank's stdout/stderr to the daemon (agent/output_capture.py)
    output_lines_per_s: float = 20_000.0  # lines captured beyond this rate are dropped and counted
    profile_steps: tuple[int, ...] = ()  # torch.profiler on these steps (agent/profiler.py)
    # On a GPU: one step in N carries device timing (0: adaptive, keeping the device calls
    # under device_budget of the step; agent/device_sampling.py).
    device_every: int = 0
    device_budget: float = 0.002
    profile_dir: str = "traceml_profiles"  # where the trace files go (traceml-daemon launch: next to the db)


def parse_host_port(text: str, default: tuple[str, int]) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too); raise ValueError when malformed."""
    text = text.strip()
    if not text:
        return default
    host, sep, port = text.rpartition(":")
    if not sep:  # a bare host keeps the default port
        return text, default[1]
    host = host.strip("[]") or default[0]
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"port {number} out of range")
    return host, number


def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected 0/1, got {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


def _fingerprint_every(value: object) -> int:
    """N >= 0 (0: off); True or "on" picks the default interval."""
    if isinstance(value, bool):
        return DEFAULT_FINGERPRINT_EVERY if value else 0
    text = str(value).strip().lower()
    if text in _TRUE - {"1"}:
        return DEFAULT_FINGERPRINT_EVERY
    if text in _FALSE:
        return 0
    number = int(text)
    if number < 0:
        raise ValueError(f"must be 0 (off) or a positive step interval, got {number}")
    return number


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"port {value} out of range")
    return value


# env variable -> (Config field, parser)
_ENV: dict[str, tuple[str, Any]] = {
    "TRACEML_DISABLE": ("disabled", _flag),
    "TRACEML_DAEMON": ("daemon", lambda s: parse_host_port(s, DEFAULT_DAEMON)),
    "TRACEML_TOKEN": ("token", lambda s: s or None),
    "TRACEML_TLS_CA": ("tls_ca", lambda s: s.strip() or None),
    "TRACEML_RELAY_PORT": ("relay_port", _port),
    "TRACEML_FLUSH_S": ("flush_s", _positive_float),
    "TRACEML_BUFFER_BYTES": ("buffer_bytes", _positive_int),
    "TRACEML_RECORDER_BYTES": ("recorder_bytes", _positive_int),
    "TRACEML_DEEP_DIVE": ("deep_dive", _flag),
    "TRACEML_DEEP_DIVE_EVERY": ("deep_dive_every", _positive_int),
    "TRACEML_FINGERPRINT_EVERY": ("fingerprint_every", _fingerprint_every),
    "TRACEML_NO_RELAY": ("start_relay", lambda s: not _flag(s)),
    "TRACEML_SHUTDOWN_S": ("shutdown_timeout_s", _positive_float),
    "TRACEML_CAPTURE_OUTPUT": ("capture_output", _flag),
    "TRACEML_OUTPUT_LINES_PER_S": ("output_lines_per_s", _positive_float),
    "TRACEML_PROFILE_STEPS": ("profile_steps", lambda s: _profile_steps(s)),
    "TRACEML_DEVICE_EVERY": ("device_every", _non_negative_int),
    "TRACEML_DEVICE_BUDGET": ("device_budget", _positive_float),
    "TRACEML_PROFILE_DIR": ("profile_dir", lambda s: s.strip() or "traceml_profiles"),
}

def _profile_steps(text: str) -> tuple[int, ...]:
    from agent.profiler import parse_steps

    return parse_steps(text)


# init() keyword aliases that read better than the field names
_ALIASES = {"disable": "disabled"}


def load_config(env: Mapping[str, str], overrides: Mapping[str, Any] | None = None) -> tuple[Config, list[str]]:
    """Build the Config; return it with a list of human-readable problems."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for name, (attr, parse) in _ENV.items():
        raw = env.get(name)
        if raw is None:
            continue
        try:
            values[attr] = parse(raw)
        except (ValueError, TypeError) as exc:
            problems.append(f"ignoring {name}: {exc}")
    known = {f.name: f.type for f in dataclasses.fields(Config)}
    for key, value in (overrides or {}).items():
        attr = _ALIASES.get(key, key)
        if attr not in known:
            problems.append(f"ignoring unknown init() argument {key!r}")
            continue
        try:
            values[attr] = _coerce(attr, value)
        except (ValueError, TypeError) as exc:
            problems.append(f"ignoring init({key}=...): {exc}")
    return Config(**values), problems


def _coerce(attr: str, value: Any) -> Any:
    """Accept the obvious Python forms of an override (env-style strings too)."""
    if attr in ("disabled", "deep_dive", "start_relay", "capture_output"):
        return _flag(value) if isinstance(value, str) else bool(value)
    if attr == "daemon":
        if isinstance(value, str):
            return parse_host_port(value, DEFAULT_DAEMON)
        host, port = value
        return str(host), _port(str(port))
    if attr == "relay_port":
        return _port(str(value))
    if attr == "fingerprint_every":
        return _fingerprint_every(value)
    if attr == "profile_steps":
        return _profile_steps(value if isinstance(value, str) else ",".join(str(int(v)) for v in value))
    if attr in ("buffer_bytes", "recorder_bytes", "deep_dive_every"):
        return _positive_int(str(int(value)))
    if attr in ("flush_s", "shutdown_timeout_s", "output_lines_per_s"):
        return _positive_float(str(value))
    if attr in ("token", "tls_ca"):
        return str(value) if value else None
    return str(value)  # relay_host
