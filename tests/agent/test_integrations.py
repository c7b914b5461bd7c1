"""Framework callbacks (agent/integrations): lazy imports, hook semantics, real steps.

Three layers:
* recording: ``agent.trace_step`` etc. replaced by recorders, to pin down the
  exact enter/exit pairing, including a step whose end hook is skipped;
* minimal loops, in a subprocess with the real agent and a real daemon: the
  hooks called in each framework's documented order around a real tiny torch
  model; the daemon's summary must show the steps;
* the real frameworks (Trainer / lightning.Trainer) when importable. They are
  not in the ``test`` extra (together ~300 MB with numpy and friends); install
  ``transformers`` and/or ``lightning`` to run those.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import agent
from agent.integrations import StepAbandoned, StepGuard, numeric_scalars
from agent.integrations import huggingface as hf
from agent.integrations import lightning as pl
from tests.support.procs import DaemonProcess, base_env, free_port, wait_for_steps

STEPS = 6


class Recorder:
    """Stands in for the agent's module-level functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.depth = 0
        self.max_depth = 0
        monkeypatch.setattr(agent, "init", lambda **kw: self.calls.append(("init",)))
        monkeypatch.setattr(agent, "shutdown", lambda: self.calls.append(("shutdown",)))
        monkeypatch.setattr(agent, "log", lambda **kw: self.calls.append(("log", kw)))
        monkeypatch.setattr(agent, "trace_step", self.trace_step)

    def trace_step(self, model: Any = None) -> Any:
        rec = self

        class Ctx:
            def __enter__(self) -> None:
                rec.depth += 1
                rec.max_depth = max(rec.max_depth, rec.depth)
                rec.calls.append(("enter", model))

            def __exit__(self, et: Any, exc: Any, tb: Any) -> bool:
                rec.depth -= 1
                rec.calls.append(("exit", et))
                return False

        return Ctx()

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


# ---------------------------------------------------------------- imports


def test_importing_integrations_imports_no_framework() -> None:
    code = ("import sys, agent.integrations, agent.integrations.huggingface, agent.integrations.lightning\n"
            "print([m for m in ('transformers', 'lightning', 'pytorch_lightning', 'torch') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_missing_framework_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "_built", None)
    monkeypatch.setitem(sys.modules, "transformers", None)  # None in sys.modules: import fails
    with pytest.raises(ImportError):
        hf.TraceMLCallback  # noqa: B018
    monkeypatch.setattr(pl, "_built", {})
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="lightning"):
        pl.TraceMLCallback  # noqa: B018
    with pytest.raises(AttributeError):
        hf.NoSuchThing  # noqa: B018


def test_callback_classes_built_on_framework_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lazy factories subclass whatever base class the installed framework provides."""
    transformers = types.ModuleType("transformers")
    transformers.TrainerCallback = type("TrainerCallback", (), {"on_epoch_begin": lambda *a, **k: "base"})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    monkeypatch.setattr(hf, "_built", None)
    cls = hf.TraceMLCallback
    assert issubclass(cls, transformers.TrainerCallback) and issubclass(cls, hf.HuggingFaceHooks)  # type: ignore[attr-defined]
    assert hf.TraceMLCallback is cls  # built once
    assert cls().on_epoch_begin(None, None, None) == "base"  # hooks we do not define stay the framework's

    # Unified `lightning` missing: fall back to pytorch_lightning.
    legacy = types.ModuleType("pytorch_lightning")
    legacy.Callback = type("Callback", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", legacy)
    monkeypatch.setattr(pl, "_built", {})
    cls = pl.TraceMLCallback
    assert issubclass(cls, legacy.Callback) and issubclass(cls, pl.LightningHooks)  # type: ignore[attr-defined]
    assert pl.callback_class("pytorch_lightning") is cls


# ---------------------------------------------------------------- recording


def hf_loop(cb: Any, model: Any, steps: int, fail_at: int | None = None) -> None:
    """Hugging Face Trainer's callback order (trainer.py, _inner_training_loop)."""

    def call(event: str, **kwargs: Any) -> None:
        method = getattr(cb, event, None)
        if method is not None:
            method(None, None, None, model=model, **kwargs)

    call("on_train_begin")
    call("on_epoch_begin")
    for step in range(steps):
        call("on_step_begin")
        try:
            if step == fail_at:
                raise RuntimeError("CUDA out of memory (simulated)")
        except RuntimeError:
            continue  # the step raised: on_step_end never runs
        call("on_step_end")
        call("on_log", logs={"loss": 1.0 / (step + 1), "learning_rate": 1e-3, "epoch": 0.5, "flag": True,
                             "note": "text"})
    call("on_epoch_end")
    call("on_train_end")


def test_hf_hooks_pair_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    model = object()
    hf_loop(hf.HuggingFaceHooks(), model, steps=3)
    assert rec.kinds() == ["init"] + ["enter", "exit", "log"] * 3 + ["shutdown"]
    assert all(c[1] is model for c in rec.calls if c[0] == "enter")
    assert all(c[1] is None for c in rec.calls if c[0] == "exit")
    # Numeric logs only; bools and strings dropped.
    assert rec.calls[3] == ("log", {"loss": 1.0, "learning_rate": 1e-3, "epoch": 0.5})


def test_hf_skipped_end_hook_closes_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    hf_loop(hf.HuggingFaceHooks(), object(), steps=4, fail_at=1)
    assert rec.max_depth == 1  # never nested
    assert rec.depth == 0  # nothing left open
    exits = [c[1] for c in rec.calls if c[0] == "exit"]
    assert exits == [None, StepAbandoned, None, None]  # the failed step closed as failed, once


def test_hf_train_end_closes_a_dangling_step(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    cb = hf.HuggingFaceHooks(init_agent=False, shutdown_agent=False, log_metrics=False)
    cb.on_train_begin(None, None, None)
    cb.on_step_begin(None, None, None, model=None)
    cb.on_train_end(None, None, None)
    assert rec.kinds() == ["enter", "exit"] and rec.calls[1][1] is StepAbandoned


def lightning_loop(cb: Any, module: Any, steps: int, fail_at: int | None = None) -> None:
    """Lightning's order (fit loop): on_train_start, per batch start/end, on_exception, on_train_end."""
    cb.on_train_start(None, module)
    try:
        for idx in range(steps):
            cb.on_train_batch_start(None, module, batch=None, batch_idx=idx)
            if idx == fail_at:
                raise RuntimeError("boom")
            cb.on_train_batch_end(None, module, outputs={"loss": 0.5}, batch=None, batch_idx=idx)
    except RuntimeError as exc:
        cb.on_exception(None, module, exc)
        return
    cb.on_train_end(None, module)


def test_lightning_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    lightning_loop(pl.LightningHooks(), object(), steps=2)
    assert rec.kinds() == ["init", "enter", "exit", "log", "enter", "exit", "log", "shutdown"]
    assert rec.calls[3] == ("log", {"loss": 0.5})

    rec.calls.clear()
    lightning_loop(pl.LightningHooks(), object(), steps=3, fail_at=1)
    assert rec.kinds() == ["init", "enter", "exit", "log", "enter", "exit"]
    assert rec.calls[-1][1] is StepAbandoned and rec.depth == 0


def test_step_guard_is_fail_open(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(model: Any = None) -> Any:
        raise ValueError("tracer bug")

    monkeypatch.setattr(agent, "trace_step", broken)
    guard = StepGuard()
    guard.begin(None)  # must not raise into the training loop
    assert not guard.open
    guard.end()
    assert numeric_scalars({"a": 1, "b": True, "c": "x", 3: 4.0, "d": 2.5}) == {"a": 1.0, "d": 2.5}


# ---------------------------------------------------------------- real agent, real daemon

SCRIPT = r'''
import sys
import torch
from torch import nn

import agent
from tests.agent.test_integrations import hf_loop, lightning_loop

which, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step() -> float:
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


class Trained:
    """Runs a real training step inside the hooks the loop calls."""

    def __init__(self, cb):
        self.cb = cb

    def __getattr__(self, name):
        method = getattr(self.cb, name)

        def hook(*args, **kwargs):
            method(*args, **kwargs)
            if name in ("on_step_begin", "on_train_batch_start"):
                train_step()
        return hook


if which == "hf":
    from agent.integrations.huggingface import HuggingFaceHooks
    hf_loop(Trained(HuggingFaceHooks()), model, steps + 1, fail_at=2)
elif which == "lightning":
    from agent.integrations.lightning import LightningHooks
    lightning_loop(Trained(LightningHooks()), model, steps)
elif which == "hf-trainer":
    from transformers import Trainer, TrainingArguments
    from agent.integrations.huggingface import TraceMLCallback

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(64)]
    args = TrainingArguments(output_dir=sys.argv[3], max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[TraceMLCallback()]).train()
elif which == "lightning-trainer":
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from agent.integrations.lightning import TraceMLCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[TraceMLCallback()],
                        default_root_dir=sys.argv[3])
    trainer.fit(Module(), loader)
'''


def run_traced(which: str, tmp_path: Path, steps: int = STEPS) -> tuple[dict[str, Any], Path, str]:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon:
        # A loaded CI machine may need more than the default 2 s at exit to hand the
        # last rows to the daemon (the rest would wait in the relay's spool).
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_SESSION=f"integration-{which}", TRACEML_SHUTDOWN_S="30")
        done = subprocess.run([sys.executable, str(script), which, str(steps), str(tmp_path / "out")], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        summary = wait_for_steps(db, ranks=1, steps=steps)
    return summary, db, done.stderr


def stored_scalars(db: Path) -> set[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return {r[0] for r in con.execute("SELECT DISTINCT name FROM scalars")}


def _need_real_agent() -> None:
    try:
        import agent.tracer  # noqa: F401  (the runtime's tracer; it imports torch)
    except ImportError as exc:
        pytest.skip(f"the agent's tracer is not available: {exc}")


@pytest.mark.slow
def test_hf_hooks_minimal_loop_real_agent(tmp_path: Path) -> None:
    _need_real_agent()
    summary, db, stderr = run_traced("hf", tmp_path)
    (rank,) = summary["ranks"]
    # STEPS + 1 begun, one of them failed mid-step: every completed step is stored.
    assert rank["steps"] >= STEPS
    assert rank["phases_ms_median"]["forward"] is not None
    assert {"loss", "learning_rate"} <= stored_scalars(db)
    assert "nested" not in stderr.lower(), stderr


@pytest.mark.slow
def test_lightning_hooks_minimal_loop_real_agent(tmp_path: Path) -> None:
    _need_real_agent()
    summary, db, _ = run_traced("lightning", tmp_path)
    (rank,) = summary["ranks"]
    assert rank["steps"] == STEPS
    assert "loss" in stored_scalars(db)


@pytest.mark.slow
def test_real_transformers_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it on torch
    _need_real_agent()
    summary, db, _ = run_traced("hf-trainer", tmp_path)
    assert summary["ranks"][0]["steps"] == STEPS
    assert "loss" in stored_scalars(db)


@pytest.mark.slow
def test_real_lightning_trainer(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _need_real_agent()
    summary, db, _ = run_traced("lightning-trainer", tmp_path)
    assert summary["ranks"][0]["steps"] == STEPS
    assert "loss" in stored_scalars(db)

