"""A policy file: TOML whose sections and keys are the ``Policy`` fields, each overriding one threshold.

    [stragglers]
    min_excess_frac = 0.2      # name a straggler only 20% above the others

    [steps]
    warmup_steps = 50

Every section, key and value is checked against the dataclasses of
``analysis/policy.py`` (read with the stdlib ``tomllib``), so a misspelt key is
an error naming the valid ones, never a threshold silently left at its
default. ``load_policy`` is the analysis package's one file read; the rest is
pure, like the engine.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from functools import cache
from typing import Any, get_type_hints

from traceml_daemon.analysis.model import PHASES
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy

__all__ = ["PolicyFileError", "load_policy", "policy_from_mapping", "policy_from_toml", "policy_overrides"]

# Counts below which a rule breaks or means nothing (a window of no steps, a creep of one
# segment divides by zero); every other number only has to be finite and not negative.
AT_LEAST: dict[tuple[str, str], int] = {
    ("steps", "min_steps"): 1,
    ("steps", "window"): 1,
    ("stragglers", "node_min_ranks"): 1,
    ("memory", "creep_segments"): 2,
    ("system", "min_samples"): 1,
    ("liveness", "step_median_window"): 1,
}


class PolicyFileError(ValueError):
    """A policy file that cannot be used; the message names the file and the key."""


@cache
def _sections() -> dict[str, tuple[type, dict[str, Any]]]:
    """Section name -> (its dataclass, field name -> resolved type)."""
    hints = get_type_hints(Policy)
    return {f.name: (hints[f.name], get_type_hints(hints[f.name])) for f in dataclasses.fields(Policy)}


def _listing(names: Mapping[str, Any] | list[str], brackets: bool = False) -> str:
    return ", ".join(f"[{n}]" if brackets else n for n in sorted(names))


_TOML_KINDS = {
    bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table",
}


def _kind(value: Any) -> str:
    kind = _TOML_KINDS.get(type(value), f"a {type(value).__name__}")
    return kind if isinstance(value, (bool, dict)) else f"{kind} ({value!r})"


def _checked(source: str, section: str, key: str, hint: Any, value: Any) -> Any:
    """``value`` converted to the field's type, or PolicyFileError saying what was expected."""
    where = f"{source}: {section}.{key}"
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyFileError(f"{where} must be a whole number, got {_kind(value)}")
        least = AT_LEAST.get((section, key), 0)
        if value < least:
            raise PolicyFileError(f"{where} must be at least {least}, got {value}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyFileError(f"{where} must be a number, got {_kind(value)}")
        if not math.isfinite(value) or value < 0:
            raise PolicyFileError(f"{where} must be a finite number, not negative, got {value!r}")
        return float(value)
    if hint == tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise PolicyFileError(f"{where} must be a list of phase names, got {_kind(value)}")
        unknown = [v for v in value if v not in PHASES]
        if unknown:
            raise PolicyFileError(f"{where}: unknown phase {unknown[0]!r}; phases are {', '.join(PHASES)}")
        return tuple(value)
    raise PolicyFileError(f"{where} cannot be set from a policy file")  # a new field type: say so, never guess


def policy_from_mapping(data: Mapping[str, Any], source: str = "policy", base: Policy = DEFAULT_POLICY) -> Policy:
    """``base`` with every threshold ``data`` names replaced (``data`` as ``tomllib`` parses it)."""
    sections = _sections()
    changed: dict[str, Any] = {}
    for section, table in data.items():
        if section not in sections:
            raise PolicyFileError(
                f"{source}: unknown section [{section}]; valid sections: {_listing(sections, brackets=True)}"
            )
        if not isinstance(table, Mapping):
            raise PolicyFileError(
                f"{source}: {section} must be a section ([{section}] with keys under it), got {_kind(table)}"
            )
        cls, hints = sections[section]
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in hints:
                raise PolicyFileError(
                    f"{source}: unknown key {key!r} in [{section}]; valid keys: {_listing(hints)}"
                )
            values[key] = _checked(source, section, key, hints[key], value)
        changed[section] = dataclasses.replace(getattr(base, section), **values)
    return dataclasses.replace(base, **changed)


def policy_from_toml(text: str, source: str = "policy") -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyFileError(f"{source} is not valid TOML: {exc}") from None
    return policy_from_mapping(data, source)


def load_policy(path: str) -> Policy:
    """The default policy with the thresholds of the TOML file at ``path``; PolicyFileError otherwise."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise PolicyFileError(f"cannot read policy file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PolicyFileError(f"{path} is not valid TOML: not UTF-8 text") from None
    return policy_from_toml(text, path)


def policy_overrides(policy: Policy, base: Policy = DEFAULT_POLICY) -> dict[str, dict[str, Any]]:
    """The thresholds where ``policy`` differs from ``base``, by section (empty: the defaults).

    The summary records them, so a verdict read later is read against the thresholds that made it."""
    out: dict[str, dict[str, Any]] = {}
    for section in _sections():
        mine, theirs = getattr(policy, section), getattr(base, section)
        diff = {
            f.name: (list(v) if isinstance(v := getattr(mine, f.name), tuple) else v)
            for f in dataclasses.fields(mine)
            if getattr(mine, f.name) != getattr(theirs, f.name)
        }
        if diff:
            out[section] = diff
    return out
