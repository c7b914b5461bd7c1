"""gc_paused: the collector is off inside and restored to what it was."""

from __future__ import annotations

import gc

import pytest

from traceml_daemon.store.gc_pause import gc_paused


def test_gc_paused_restores_an_enabled_collector_even_on_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_gc_paused_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
