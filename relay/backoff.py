"""Reconnect delays: exponential backoff with full jitter (pure, no sleeping).

Jitter keeps the 64 relays of a job from reconnecting in lock-step after a
daemon restart; the cap keeps the gap after a long outage short.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    def __init__(
        self,
        initial: float = 0.1,
        cap: float = 5.0,
        factor: float = 2.0,
        jitter: float = 0.5,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if initial <= 0 or cap < initial or factor < 1 or not 0 <= jitter <= 1:
            raise ValueError("need 0 < initial <= cap, factor >= 1, 0 <= jitter <= 1")
        self.initial = initial
        self.cap = cap
        self.factor = factor
        self.jitter = jitter
        self._rand = rand
        self._base = initial
        self.attempts = 0

    def next_delay(self) -> float:
        """The delay before the next attempt; grows until ``cap``.

        The result lies in [base * (1 - jitter), base], so it never exceeds the
        cap and never collapses to zero.
        """
        base = self._base
        self._base = min(self.cap, self._base * self.factor)
        self.attempts += 1
        return base * (1.0 - self.jitter * self._rand())

    def reset(self) -> None:
        """Call after a connection succeeded: the next failure retries quickly."""
        self._base = self.initial
        self.attempts = 0
