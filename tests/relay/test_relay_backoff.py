"""Reconnect backoff: grows, caps, jitters downward only, resets."""

from __future__ import annotations

import pytest

from relay.backoff import Backoff


def test_doubles_to_cap_without_jitter() -> None:
    b = Backoff(initial=0.1, cap=1.0, jitter=0.0)
    assert [round(b.next_delay(), 6) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.attempts == 6


def test_jitter_stays_within_bounds() -> None:
    low = Backoff(initial=0.1, cap=5.0, jitter=0.5, rand=lambda: 1.0)
    high = Backoff(initial=0.1, cap=5.0, jitter=0.5, rand=lambda: 0.0)
    for _ in range(20):
        lo, hi = low.next_delay(), high.next_delay()
        assert 0 < lo <= hi <= 5.0
        assert lo == pytest.approx(hi / 2)


def test_reset_starts_over() -> None:
    b = Backoff(initial=0.1, cap=5.0, jitter=0.0)
    for _ in range(10):
        b.next_delay()
    b.reset()
    assert b.next_delay() == pytest.approx(0.1) and b.attempts == 1


@pytest.mark.parametrize("kw", [{"initial": 0}, {"initial": 2, "cap": 1}, {"factor": 0.5}, {"jitter": 1.5}])
def test_rejects_bad_parameters(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kw)
