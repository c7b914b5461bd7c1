"""Numerics fingerprints on CPU with real torch: values, order, non-finite counts, off costs nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from agent.capture.guard import ErrorGate
from agent.fingerprint import Fingerprints, FingerprintStepContext, ModelFingerprint, Taken, bit_sum
from agent.fingerprint import _rows as fingerprint_rows
from agent.recorder import Recorder
from agent.tracer import Tracer, _StepContext


def _int32_sum(bits: np.ndarray) -> int:
    total = int(bits.astype(np.int64).sum()) % 2**32
    return total - 2**32 if total >= 2**31 else total


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@pytest.fixture()
def fp_tracer() -> Iterator[tuple[Tracer, Recorder]]:
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None, fingerprint_every=3)
    tracer.install()
    yield tracer, recorder
    tracer.uninstall()


def _train(tracer: Tracer, model: torch.nn.Module, steps: int, poison_at: int | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for step in range(steps):
        with tracer.trace_step(model):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step == poison_at:
                model[2].weight.grad[0, 1] = float("nan")  # type: ignore[index]
                model[2].weight.grad[0, 2] = float("inf")  # type: ignore[index]
            opt.step()


def _rows(tracer: Tracer, recorder: Recorder) -> dict[str, list[object]]:
    tracer.poll(final=True)
    return recorder.drain().get("fingerprints", {})


def test_every_nth_step_fingerprints_every_parameter_in_order(fp_tracer: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = fp_tracer
    model = _model()
    _train(tracer, model, 7)
    rows = _rows(tracer, recorder)
    names = [n for n, _ in model.named_parameters()]
    assert rows["step"] == [s for s in (0, 3, 6) for _ in names]
    assert rows["layer"][: len(names)] == names and rows["idx"][: len(names)] == list(range(len(names)))
    # The last fingerprint holds the parameters as the optimizer left them: float32 norms (to
    # float32 rounding: the host's kernel is BLAS), and the bits summed as integers, wrapping at 32 bits.
    for i, p in enumerate(model.parameters()):
        at = 2 * len(names) + i
        for got, t in ((rows["param_norm"][at], p.detach()), (rows["grad_norm"][at], p.grad)):
            assert isinstance(got, float) and float(np.float32(got)) == got
            assert got == pytest.approx(torch.linalg.vector_norm(t.double()).item(), rel=2**-20)  # type: ignore[union-attr]
        assert rows["grad_nonfinite"][at] == 0 and rows["shard"][at] == 0
        assert rows["param_sum"][at] == _int32_sum(p.detach().numpy().view(np.uint32))
    assert isinstance(tracer.models[id(model)], FingerprintStepContext)


def test_non_finite_gradient_values_are_counted(fp_tracer: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = fp_tracer
    model = _model()
    _train(tracer, model, 4, poison_at=3)
    rows = _rows(tracer, recorder)
    at = [i for i, (s, layer) in enumerate(zip(rows["step"], rows["layer"], strict=True))
          if s == 3 and layer == "2.weight"]
    assert rows["grad_nonfinite"][at[0]] == 2
    assert math.isnan(rows["grad_norm"][at[0]])  # type: ignore[arg-type]
    others = [rows["grad_nonfinite"][i] for i, s in enumerate(rows["step"]) if s == 3 and i != at[0]]
    assert others == [0, 0, 0]


def test_a_parameter_without_gradient_has_none(fp_tracer: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = fp_tracer
    model = _model()
    model[0].bias.requires_grad_(False)  # type: ignore[union-attr]
    _train(tracer, model, 1)
    rows = _rows(tracer, recorder)
    i = rows["layer"].index("0.bias")
    assert rows["grad_norm"][i] is None and rows["grad_nonfinite"][i] is None
    assert rows["param_norm"][i] is not None


def test_a_step_that_raised_is_not_fingerprinted(fp_tracer: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = fp_tracer
    model = _model()
    with pytest.raises(RuntimeError), tracer.trace_step(model):
        raise RuntimeError("user error")
    assert _rows(tracer, recorder) == {}


def test_off_by_default_the_plain_step_context() -> None:
    tracer = Tracer(Recorder(), event_backend=None)
    model = _model()
    assert type(tracer.trace_step(model)) is _StepContext
    assert "fingerprints_dropped" not in tracer.counters()
    tracer.uninstall()


def test_past_the_bound_the_oldest_is_dropped_and_counted() -> None:
    fps = Fingerprints(1, ErrorGate(lambda kind, msg: None), max_pending=2)
    fp = ModelFingerprint(0, _model())
    for step in range(5):
        fps.take(step, fp, None)
    rows = fps.resolve(None, 10**9)
    assert fps.dropped == 3 and sorted({r["step"] for r in rows}) == [3, 4]


def _sums(taken: Taken | None) -> list[int]:
    assert taken is not None
    return [int(v) for v in (taken.sums if isinstance(taken.sums, list) else taken.sums.tolist())]


def test_one_ulp_on_one_element_changes_that_tensors_bit_sum_only() -> None:
    model = _model()
    fp = ModelFingerprint(0, model)
    before = _sums(fp.compute())
    with torch.no_grad():
        w = model[0].weight  # type: ignore[index]
        w[3, 1] = torch.nextafter(w[3, 1], torch.tensor(math.inf))
    after = _sums(fp.compute())
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [0]


def test_a_ulp_a_float_norm_rounds_away_still_changes_the_bit_sum() -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(512, 512)
    with torch.no_grad():
        model.weight[7, 7] = 1e-6  # far below the others: its ULP is lost in any float norm's rounding
    fp = ModelFingerprint(0, model)
    norm64 = torch.linalg.vector_norm(model.weight.detach().double()).item()
    before = _sums(fp.compute())
    with torch.no_grad():
        model.weight[7, 7] = torch.nextafter(model.weight[7, 7], torch.tensor(1.0))
    assert torch.linalg.vector_norm(model.weight.detach().double()).item() == norm64
    assert _sums(fp.compute())[0] == before[0] + 1


def test_bit_sums_of_shards_add_up_to_the_whole_and_cover_every_float_width() -> None:
    torch.manual_seed(2)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        t = torch.randn(6, 5).to(dtype)
        whole = int(bit_sum(t))
        parts = sum(int(bit_sum(part)) for part in t.split([2, 4])) % 2**32
        assert parts == whole % 2**32, dtype
        up = t.clone()
        up.view(-1)[13] = torch.nextafter(up.view(-1)[13], torch.tensor(math.inf, dtype=dtype))
        assert int(bit_sum(up)) != whole, dtype


def test_the_parameters_integer_views_follow_a_moved_storage() -> None:
    model = _model()
    fp = ModelFingerprint(0, model)
    first = _sums(fp.compute())
    with torch.no_grad():
        model[0].weight.data = model[0].weight.detach() * 2  # type: ignore[index]
    assert _sums(fp.compute())[0] == int(bit_sum(model[0].weight.detach())) != first[0]  # type: ignore[index]


def test_the_setting_from_the_environment_and_init() -> None:
    from agent.config import DEFAULT_FINGERPRINT_EVERY, load_config

    assert load_config({})[0].fingerprint_every == 0
    assert load_config({"TRACEML_FINGERPRINT_EVERY": "10"})[0].fingerprint_every == 10
    assert load_config({}, {"fingerprint_every": True})[0].fingerprint_every == DEFAULT_FINGERPRINT_EVERY
    config, problems = load_config({"TRACEML_FINGERPRINT_EVERY": "-1"})
    assert config.fingerprint_every == 0 and "TRACEML_FINGERPRINT_EVERY" in problems[0]


def test_parameters_numpy_cannot_read_in_place_take_torchs_way_to_the_same_numbers() -> None:
    torch.manual_seed(3)
    model = _model()
    twin = _model()
    with torch.no_grad():  # the same values, the first weight held transposed (not contiguous)
        twin[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())  # type: ignore[index]
    fps = [ModelFingerprint(0, m) for m in (model, twin)]
    x = torch.randn(16, 4)
    for m in (model, twin):
        m(x).sum().backward()
        m[2].weight.grad[0, 3] = float("inf")  # type: ignore[index]
    host, device_way = (fp.compute() for fp in fps)
    assert fps[0]._host is not None and fps[1]._host is None
    assert host is not None and device_way is not None and host.squared and not device_way.squared
    assert _sums(host) == _sums(device_way) == [int(bit_sum(p.detach())) for p in model.parameters()]
    assert host.counts == device_way.counts == [0, 0, 1, 0]
    rows = [fingerprint_rows(0, fp, t) for fp, t in zip(fps, (host, device_way), strict=True)]
    for a, b in zip(*rows, strict=True):
        assert a["param_norm"] == pytest.approx(b["param_norm"], rel=2**-20)
        assert a["grad_nonfinite"] == b["grad_nonfinite"] and a["param_sum"] == b["param_sum"]


def test_bit_sums_follow_in_place_updates_of_every_layout_and_width() -> None:
    torch.manual_seed(4)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64).t())  # 8-byte, not adjacent: a copy
    model.b = torch.nn.Parameter(torch.randn(5, 2).to(torch.bfloat16))  # torch's way (numpy has no bf16)
    model.c = torch.nn.Parameter(torch.randn(6, 2).t())  # 4-byte, transposed: still a view
    fp = ModelFingerprint(0, model)
    params = list(model.parameters())
    for _ in range(2):
        got = _sums(fp.compute())
        assert got == [int(bit_sum(p.detach().contiguous())) for p in params]
        with torch.no_grad():
            for p in params:
                p[0, 1] += 1  # in place: the storage stays, the next sums must move
    assert fp._host is None
