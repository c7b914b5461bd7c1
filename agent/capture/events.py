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
    """Pooled ``torch.cuda.Event(enable_timing=True)``; created lazily up to ``cap``.

    Every call here runs on the training thread, so each goes straight to torch's C
    functions where the public wrappers cost far more than the work (bench/cuda_calls.py):
    ``max_memory_allocated()`` and ``memory_reserved()``
    each build and flatten the allocator's whole statistics dict in Python, and
    ``Event.record()`` builds a new ``Stream`` object to find the current stream.
    Here one statistics read gives both figures, and streams are looked up by their
    C id in a small cache. Where a private function is missing (another torch) the
    public API is used instead.
    """

    def __init__(self, cap: int = 8192) -> None:
        import torch

        self._torch = torch
        # Per device: an event is bound to the device of its first record.
        self._free: dict[int, list[Any]] = {}
        self._created = 0
        self.cap = cap
        self.exhausted = 0
        self._streams: dict[tuple[int, int, int], Any] = {}
        c = torch._C
        try:
            self._device = c._cuda_getDevice
            self._stream_key = c._cuda_getCurrentStream
            self._record = c._CudaEventBase.record
            self._stats = c._cuda_memoryStats
            self._reset = c._cuda_resetPeakMemoryStats
            self._fast = True
        except AttributeError:
            self._fast = False

    def _new_stream(self, key: tuple[int, int, int]) -> Any:
        """The Stream object for a current-stream key not seen yet (then cached)."""
        stream = self._torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        if len(self._streams) < 256:  # a job that makes streams without end stays bounded
            self._streams[key] = stream
        return stream

    def mark(self) -> Any | None:
        # list.pop/append are atomic under the GIL: the comm-hook callback
        # thread and the training thread may both mark without a lock.
        fast = self._fast
        device = self._device() if fast else self._torch.cuda.current_device()
        free = self._free.get(device)
        if free is None:
            free = self._free.setdefault(device, [])
        try:
            ev = free.pop()
        except IndexError:
            if self._created >= self.cap:
                self.exhausted += 1
                return None
            ev = self._torch.cuda.Event(enable_timing=True)
            ev._traceml_device = device
            self._created += 1
        if fast:
            # The current stream by its C id (a tuple), the Stream object from the cache.
            key = self._stream_key(device)
            stream = self._streams.get(key)
            self._record(ev, stream if stream is not None else self._new_stream(key))
        else:
            ev.record()
        return ev

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return int(start.elapsed_time(end) * 1_000_000.0)

    def release(self, event: Any) -> None:
        self._free.setdefault(event._traceml_device, []).append(event)

    def reset_peak(self) -> None:
        if self._fast:
            self._reset(self._device())
        else:
            self._torch.cuda.reset_peak_memory_stats()

    def memory(self) -> tuple[int | None, int | None]:
        if self._fast:
            stats = self._stats(self._device())
            return int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["current"])
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
