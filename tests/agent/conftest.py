"""Fixtures for the agent tests (the fake relay lives in fake_relay.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.recorder import Recorder
from agent.tracer import Tracer
from tests.agent.fake_relay import FakeRelay


@pytest.fixture
def fake_relay() -> Iterator[FakeRelay]:
    relay = FakeRelay()
    yield relay
    relay.close()


@pytest.fixture
def make_relay() -> Iterator[Callable[..., FakeRelay]]:
    made: list[FakeRelay] = []

    def make(**kwargs: Any) -> FakeRelay:
        relay = FakeRelay(**kwargs)
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.close()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def tracer(recorder: Recorder) -> Iterator[Tracer]:
    """An installed host-clock Tracer (no device events), uninstalled after the test."""
    t = Tracer(recorder, event_backend=None)
    t.install()
    yield t
    t.uninstall()
