"""Time blocked in ``DataLoader`` iteration, via one global class patch.

``_BaseDataLoaderIter.__next__`` is shared by the single- and multi-process
iterators (they only override ``_next_data``), so one patch covers both,
including ``num_workers>0`` under fork: the blocking ``__next__`` always runs
in the training process. Attribution to a step is the Tracer's job
(``_on_fetch``); this module only measures.
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
        try:
            tracer._on_fetch(self, t1 - t0, t1)
        except Exception as exc:
            tracer._gate.fail("dataloader", exc)
        return batch

    cls.__next__ = __next__  # type: ignore[method-assign]

    def undo() -> None:
        if cls.__dict__.get("__next__") is __next__:
            cls.__next__ = orig  # type: ignore[method-assign]

    return undo
