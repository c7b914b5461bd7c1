"""Time blocked in ``DataLoader`` iteration, via one global class patch.

``_BaseDataLoaderIter.__next__`` is shared by the single- and multi-process
iterators (they only override ``_next_data``), so one patch covers both,
including ``num_workers>0`` under fork: the blocking ``__next__`` always runs
in the training process.

Attribution is inlined here (one call less per batch). A fetch inside a step
is part of that step. One before it is charged by the next step's enter: the
loader that fed the previous step ("fed" loader) stores its wait in one slot,
``Tracer._fed_ns``, the common case; any other loader's fetch is remembered
per dataset in ``Tracer._fetches`` and sorted out by ``Tracer._take_fetch``,
so a validation loader iterated between steps is never charged to training.
While a fetch blocks, ``Tracer._dl_t0`` holds its start for ``status()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def install(tracer: Any) -> Callable[[], None]:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    cls = _BaseDataLoaderIter
    orig = cls.__next__
    perf = time.perf_counter_ns
    fail = tracer._gate.fail

    def __next__(self: Any) -> Any:
        t0 = perf()
        tracer._dl_t0 = t0
        try:
            batch = orig(self)
        finally:
            # StopIteration ends an epoch: nothing consumed, just leave the phase.
            tracer._dl_t0 = 0
        t1 = perf()
        try:
            rec = tracer._active
            if rec is not None:
                rec.dl_in += t1 - t0
                rec.has_dl = True
                rec.ph_end = t1
                tracer._any_fetch = True
                return batch
            key = id(self._dataset)  # set by _BaseDataLoaderIter.__init__
            if key == tracer._fed_by:
                tracer._fed_ns = t1 - t0  # the last fetch before the step is the one it consumes
            else:
                seq = tracer._fetch_seq + 1
                tracer._fetch_seq = seq
                tracer._fetches[key] = (seq, t1 - t0)
                tracer._any_fetch = True
                tracer._rare = True  # the next step's enter sorts the loaders out
        except Exception as exc:
            fail("dataloader", exc)
        return batch

    cls.__next__ = __next__  # type: ignore[method-assign]

    def undo() -> None:
        if cls.__dict__.get("__next__") is __next__:
            cls.__next__ = orig  # type: ignore[method-assign]

    return undo
