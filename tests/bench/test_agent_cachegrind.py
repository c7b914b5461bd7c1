"""bench/agent_cachegrind.py: cachegrind output read back per function, and per-step differences.

The bench itself runs torch under valgrind (minutes a run), so these tests feed its
reader files in cachegrind's own format instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "agent_cachegrind", Path(__file__).parents[2] / "bench" / "agent_cachegrind.py")
assert _SPEC is not None and _SPEC.loader is not None
agent_cachegrind = importlib.util.module_from_spec(_SPEC)
sys.modules["agent_cachegrind"] = agent_cachegrind
_SPEC.loader.exec_module(agent_cachegrind)

HEADER = """\
desc: I1 cache:         32768 B, 64 B, 8-way associative
cmd: python -c ...
events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw
"""


def _write(path: Path, body: str) -> Path:
    path.write_text(HEADER + body + "summary: 0 0 0 0 0 0 0 0 0\n")
    return path


def test_counts_are_summed_per_function_across_lines_files_and_recursion_depths(tmp_path: Path) -> None:
    out = _write(tmp_path / "cg.out", """\
fl=Python/ceval.c
fn=_PyEval_EvalFrameDefault
10 100 3 0 40 2 0 10 1 0
11 50 1 0 20 1 0 5 0 0
fn=_PyEval_EvalFrameDefault'2
10 7 1 0 2 0 0 1 0 0
fl=Objects/longobject.c
fn=x_sub
5 30 2
""")
    got = agent_cachegrind.load(out)
    assert got["_PyEval_EvalFrameDefault"]["Ir"] == 157
    assert got["_PyEval_EvalFrameDefault"]["I1mr"] == 5
    assert got["_PyEval_EvalFrameDefault"]["D1mr"] == 3
    assert got["_PyEval_EvalFrameDefault"]["D1mw"] == 1
    # A line may stop early (trailing zero counts left out): the missing events stay 0.
    assert got["x_sub"]["Ir"] == 30 and got["x_sub"]["I1mr"] == 2 and got["x_sub"]["D1mr"] == 0


def test_per_step_is_the_difference_of_the_two_runs_divided_by_the_counted_steps() -> None:
    short = {"f": {"Ir": 1000, "I1mr": 10, "D1mr": 5, "D1mw": 1, "ILmr": 2, "DLmr": 0, "DLmw": 0}}
    long = {"f": {"Ir": 1600, "I1mr": 30, "D1mr": 9, "D1mw": 1, "ILmr": 4, "DLmr": 20, "DLmw": 0}, "g": {"Ir": 200}}
    got = agent_cachegrind.per_step(short, long, steps=200)
    assert got["f"] == {"Ir": 3.0, "I1mr": 0.1, "D1mr": 0.02, "D1mw": 0.0, "ILmr": 0.01, "DLmr": 0.1, "DLmw": 0.0}
    assert got["g"]["Ir"] == 1.0 and got["g"]["I1mr"] == 0.0  # only in the longer run


def test_without_valgrind_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_cachegrind.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="valgrind is not installed"):
        agent_cachegrind.main(["--modes", "none,tracer"])


def test_mode_ref_needs_a_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        agent_cachegrind.main(["--modes", "none,ref"])
    assert "mode ref needs --reference" in capsys.readouterr().err


def test_cycle_estimate_weighs_l1_misses_10_and_last_level_misses_100() -> None:
    counts = {"Ir": 1000.0, "I1mr": 3.0, "D1mr": 2.0, "D1mw": 1.0, "ILmr": 1.0, "DLmr": 0.5, "DLmw": 0.5}
    assert agent_cachegrind.cycles_estimate(counts) == 1000 + 10 * 6 + 100 * 2


@pytest.mark.parametrize("sizes", ["4,x", "0", ","])
def test_bad_model_sizes_are_named(sizes: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        agent_cachegrind.main(["--modules", sizes])
    assert "--modules" in capsys.readouterr().err


def test_top_functions_rank_extra_misses_first_and_instructions_either_way() -> None:
    diff = {
        "a": {"Ir": 500.0, "I1mr": 1.0, "D1mr": 9.0, "D1mw": 0.0},
        "b": {"Ir": -900.0, "I1mr": 7.0, "D1mr": -4.0, "D1mw": 1.0},
        "c": {"Ir": 10.0, "I1mr": 3.0, "D1mr": 2.0, "D1mw": 2.0},
    }
    assert agent_cachegrind.top_functions(diff, ("I1mr",), 2) == ["b", "c"]
    assert agent_cachegrind.top_functions(diff, ("D1mr", "D1mw"), 3) == ["a", "c", "b"]
    assert agent_cachegrind.top_functions(diff, ("Ir",), 1) == ["a"]  # the most extra
    assert agent_cachegrind.top_functions(diff, ("Ir",), 1, either_way=True) == ["b"]  # fewer count too
