"""Device timing without synchronization: a pool of reusable timing events.

The training thread only ``mark()``s (record an event on the current stream,
microseconds, no sync); the sender thread later asks ``done()`` (a
non-blocking query) and, once every event of a step completed, reads
``elapsed_ns``. Events go back to the pool after resolution, so steady state
allocates nothing. The backend is a Protocol so tests drive the same code
with a fake device.
"""

from __future__ import annotations

from typing import Any, Protocol


class EventBackend(Protocol):
    exhausted: int

    def mark(self) -> Any | None:
        """Record an event now on the current stream; None when the pool is exhausted."""

    def done(self, event: Any) -> bool:
        """Non-blocking: has the device reached this event?"""

    def elapsed_ns(self, start: Any, end: Any) -> int:
        """Device time between two completed events."""

    def release(self, event: Any) -> None:
        """Return an event to the pool (it may be recorded again)."""

    def reset_peak(self) -> None:
        """Start a new peak-memory window (per step)."""

    def memory(self) -> tuple[int | None, int | None]:
        """(peak allocated since reset_peak, reserved) in bytes, read without sync."""


class CudaEventBackend:
    """Pooled ``torch.cuda.Event(enable_timing=True)``; created lazily up to ``cap``."""

    def __init__(self, cap: int = 8192) -> None:
        import torch

        self._torch = torch
        self._free: list[Any] = []
        self._created = 0
        self.cap = cap
        self.exhausted = 0

    def mark(self) -> Any | None:
        # list.pop/append are atomic under the GIL: the comm-hook callback
        # thread and the training thread may both mark without a lock.
        try:
            ev = self._free.pop()
        except IndexError:
            if self._created >= self.cap:
                self.exhausted += 1
                return None
            ev = self._torch.cuda.Event(enable_timing=True)
            self._created += 1
        ev.record()
        return ev

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return int(start.elapsed_time(end) * 1_000_000.0)

    def release(self, event: Any) -> None:
        self._free.append(event)

    def reset_peak(self) -> None:
        self._torch.cuda.reset_peak_memory_stats()

    def memory(self) -> tuple[int | None, int | None]:
        cuda = self._torch.cuda
        return int(cuda.max_memory_allocated()), int(cuda.memory_reserved())


def default_backend() -> EventBackend | None:
    """CUDA events when a GPU is usable, else None (host clock only)."""
    try:
        import torch

        if torch.cuda.is_available():
            return CudaEventBackend()
    except Exception:
        pass
    return None
