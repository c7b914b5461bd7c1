"""Building the runtime's step tracer: is there torch to trace, which tracer, with what.

The runtime calls ``build_tracer`` once (normally on the sender thread, see
agent.rank_runtime) and keeps the result; everything here is fail-open: a tracer that
cannot be made or installed is reported once and the rank sends resource samples
only. Nothing here imports torch or the capture modules until a build asks for them.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from agent.config import Config
from agent.errors import ErrorReporter
from agent.recorder import Recorder

TracerFactory = Callable[..., Any]

# The base install (a head node's) has no torch; ranks need the agent extra.
NO_TORCH_MESSAGE = (
    "torch is not installed, so the agent is off (every call is a no-op): "
    "pip install 'traceml-daemon[agent]' in the training environment"
)


def torch_installed() -> bool:
    """torch can be imported here, found without importing it (init() must stay light)."""
    if sys.modules.get("torch") is not None:
        return True
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or blocked torch is as good as none
        return False


def torch_imported() -> bool:
    """torch is in sys.modules and done initializing (not mid-import on another thread)."""
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is not None and not getattr(spec, "_initializing", False)


def default_tracer_factory() -> TracerFactory:
    from agent.tracer import Tracer  # lazy: the tracer imports torch

    return Tracer


def device_sampling(config: Config) -> dict[str, Any]:
    """The tracer's device_sampling keyword, only when the configuration asks for other than the default."""
    from agent.device_sampling import DeviceSamplingPolicy

    policy = DeviceSamplingPolicy(budget=config.device_budget, every=config.device_every or None)
    return {} if policy == DeviceSamplingPolicy() else {"device_sampling": policy}


def build_tracer(
    tracer_factory: Callable[[], TracerFactory], recorder: Recorder, config: Config, reporter: ErrorReporter
) -> Any:
    """A tracer made from the config and installed; None (reported) when either step failed."""
    tracer: Any = None
    try:
        factory = tracer_factory()
        tracer = factory(
            recorder,
            deep_dive=config.deep_dive,
            deep_dive_every=config.deep_dive_every,
            # Only when on: a tracer factory of a test or plug-in need not know the keyword.
            **({"fingerprint_every": config.fingerprint_every} if config.fingerprint_every else {}),
            **device_sampling(config),
            # The tracer warns once per kind with an unprefixed message; one reporter
            # key per kind so every kind's first failure prints (with one prefix).
            # "notice:" kinds (ErrorGate.notice) are said once but are not failures.
            warn=lambda kind, msg: (reporter.notice if kind.startswith("notice:") else
                                    reporter.report)(f"tracer:{kind}", msg),
        )
    except Exception as exc:
        reporter.report("tracer", f"step capture unavailable ({exc!r}); sending resource samples only")
    if tracer is not None:
        try:
            tracer.install()
        except Exception as exc:
            reporter.report("tracer", f"step capture unavailable ({exc!r})")
            tracer = None
    return tracer


def contexts_fail_open(tracer: Any) -> bool:
    """Only a tracer that says so (agent.tracer.Tracer) is trusted to hand out contexts that
    never raise and never swallow; any other (a test double, a plug-in) gets Guarded."""
    return getattr(tracer, "FAIL_OPEN_CONTEXTS", False) is True
