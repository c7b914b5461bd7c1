"""Time blocked in ``DataLoader`` iteration, via one global class patch.

``_BaseDataLoaderIter.__next__`` is shared by the single- and multi-process
iterators (they only override ``_next_data``), so one patch covers both,
including ``num_workers>0`` under fork: the blocking ``__next__`` always runs
in the training process. Attribution is inlined here (a fetch inside a step
is part of it; one before it is remembered per dataset and charged by the
step's enter, ``Tracer._take_fetch``) to save a call per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.capture.record import IDLE, PH_DATALOADER, PH_WAIT


def install(tracer: Any) -> Callable[[], None]:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    cls = _BaseDataLoaderIter
    orig = cls.__next__
    perf = time.perf_counter_ns
    fail = tracer._gate.fail

    def __next__(self: Any) -> Any:
        t0 = perf()
        tracer._status = (PH_DATALOADER, t0, tracer._status[2])
        try:
            batch = orig(self)
        except BaseException:
            # StopIteration ends an epoch: nothing consumed, just leave the phase.
            tracer._status = (IDLE if tracer._active is None else PH_WAIT, perf(), tracer._status[2])
            raise
        t1 = perf()
        # Attribution, inlined (one call less per batch): a fetch inside a step is already
        # within its time; one before it is remembered per dataset, and the step's enter
        # charges the right one (Tracer._take_fetch).
        try:
            tracer._any_fetch = True
            rec = tracer._active
            if rec is not None:
                rec.dl_in += t1 - t0
                rec.has_dl = True
                tracer._status = (PH_WAIT, t1, rec.step)
            else:
                seq = tracer._fetch_seq + 1
                tracer._fetch_seq = seq
                tracer._fetches[id(getattr(self, "_dataset", self))] = (seq, t1 - t0)
                tracer._status = (IDLE, t1, tracer._status[2])
        except Exception as exc:
            fail("dataloader", exc)
        return batch

    cls.__next__ = __next__  # type: ignore[method-assign]

    def undo() -> None:
        if cls.__dict__.get("__next__") is __next__:
            cls.__next__ = orig  # type: ignore[method-assign]

    return undo
