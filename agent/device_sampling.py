"""Which steps carry device timing: every step on the host, the device on a budget.

On a GPU, timing a step's phases on the device costs host time on the training
thread: a timing event recorded at every phase boundary, the allocator's peak
read and reset. Every step is still timed on the host; the device path (events,
memory peak) runs on sampled steps only, and an unsampled step makes no device
call at all.

Adaptive (the default): after each sampled step, the sampler compares the host
time its device calls took (the backend counts it) with the step's own time,
and waits as many steps as keep that cost under ``budget`` of the training
time, never more than ``max_every``. A fixed interval (``every``) replaces it
when asked (``TRACEML_DEVICE_EVERY``). Rows say which steps carry device timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSamplingPolicy:
    # Share of the training thread's time the device calls may take (0.002: 0.2%).
    budget: float = 0.002
    # Fixed interval: one step in ``every`` carries device timing; None: adaptive.
    every: int | None = None
    # The adaptive interval never grows past this, so a phase's device time stays current.
    max_every: int = 64


class DeviceSampler:
    """Decides, at each step's exit, whether the next step carries device timing."""

    __slots__ = ("policy", "interval", "_wait", "sampled", "skipped")

    def __init__(self, policy: DeviceSamplingPolicy | None = None) -> None:
        self.policy = policy or DeviceSamplingPolicy()
        self.interval = self.policy.every or 1
        self._wait = 0  # steps left before the next sampled one
        self.sampled = 0
        self.skipped = 0

    def next_is_sampled(self) -> bool:
        """Consume one step: whether it is a sampled one (the first step always is)."""
        if self._wait > 0:
            self._wait -= 1
            self.skipped += 1
            return False
        self._wait = self.interval - 1
        self.sampled += 1
        return True

    @property
    def next_will_be_sampled(self) -> bool:
        """Whether the next ``next_is_sampled()`` says yes (nothing consumed)."""
        return self._wait == 0

    def observe(self, device_calls_ns: int, step_ns: int) -> None:
        """A sampled step's cost of device calls and its length, both host nanoseconds."""
        policy = self.policy
        if policy.every is not None or step_ns <= 0:
            return
        allowed = policy.budget * step_ns
        wanted = math.ceil(device_calls_ns / allowed) if allowed > 0 else policy.max_every
        self.interval = max(1, min(policy.max_every, wanted))
        self._wait = self.interval - 1  # counted from this sampled step

    def statistics(self) -> dict[str, int]:
        return {"device_steps_sampled": self.sampled, "device_steps_host_only": self.skipped,
                "device_sampling_interval": self.interval}


# Device timing on every step (tests of the device path, and anyone who wants it at any cost).
EVERY_STEP = DeviceSamplingPolicy(every=1)
