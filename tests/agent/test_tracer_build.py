"""Building the runtime's tracer: the keywords it gets from the config, and failures
that leave the rank without step capture instead of raising."""

from __future__ import annotations

from typing import Any

from agent.config import load_config
from agent.errors import ErrorReporter
from agent.recorder import Recorder
from agent.tracer_build import build_tracer, contexts_fail_open


class Made:
    """A tracer double that keeps what it was made with."""

    FAIL_OPEN_CONTEXTS = False
    broken_install = False

    def __init__(self, recorder: Recorder, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.installed = False

    def install(self) -> None:
        if self.broken_install:
            raise RuntimeError("no hooks")
        self.installed = True


def test_keywords_follow_the_config_and_the_tracer_is_installed() -> None:
    reporter = ErrorReporter()
    config, _ = load_config({"TRACEML_DEEP_DIVE": "1"})
    tracer = build_tracer(lambda: Made, Recorder(1 << 16), config, reporter)
    assert tracer.installed and tracer.kwargs["deep_dive"] is True
    # Optional keywords only when they are not the default: a plug-in factory need not know them.
    assert "fingerprint_every" not in tracer.kwargs and "device_sampling" not in tracer.kwargs
    config, _ = load_config({"TRACEML_FINGERPRINT_EVERY": "5", "TRACEML_DEVICE_EVERY": "3"})
    tracer = build_tracer(lambda: Made, Recorder(1 << 16), config, reporter)
    assert tracer.kwargs["fingerprint_every"] == 5 and tracer.kwargs["device_sampling"].every == 3
    tracer.kwargs["warn"]("notice:skipped", "said, not counted")
    tracer.kwargs["warn"]("hook", "counted")
    assert reporter.counts == {"tracer:hook": 1}


def test_a_factory_or_install_failure_leaves_no_tracer(capsys: Any) -> None:
    config, _ = load_config({})

    def broken_factory() -> Any:
        raise ImportError("no torch here")

    assert build_tracer(broken_factory, Recorder(1 << 16), config, ErrorReporter()) is None
    assert "step capture unavailable" in capsys.readouterr().err

    class BrokenInstall(Made):
        broken_install = True

    reporter = ErrorReporter()
    assert build_tracer(lambda: BrokenInstall, Recorder(1 << 16), config, reporter) is None
    assert reporter.counts == {"tracer": 1}


def test_only_a_tracer_that_says_so_hands_out_unguarded_contexts() -> None:
    class Trusted:
        FAIL_OPEN_CONTEXTS = True

    class Truthy:
        FAIL_OPEN_CONTEXTS = 1  # not the literal True

    assert contexts_fail_open(Trusted())
    assert not contexts_fail_open(Truthy()) and not contexts_fail_open(Made) and not contexts_fail_open(None)
