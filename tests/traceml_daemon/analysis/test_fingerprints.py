"""analysis/fingerprints (pure) and store/read/fingerprints on a real SQLite file."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import numpy as np

from traceml_daemon.analysis.fingerprints import (
    FingerprintEvidence,
    FingerprintRow,
    compare_fingerprints,
    format_fingerprints,
    nonfinite_grad_verdicts,
    replica_verdicts,
)
from traceml_daemon.analysis.policy import NumericsPolicy
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.read import fingerprints
from traceml_daemon.store.read.runs import RunRef

POLICY = NumericsPolicy()


def row(rank: int, idx: int, param: float, grad: float | None = 1.0, nonfinite: int | None = 0,
        step: int = 7, bits: int | None = None) -> FingerprintRow:
    # bits None: a row from before bit sums, compared on its norms
    return FingerprintRow(rank, step, 0, idx, f"l{idx}", param, grad, nonfinite, bits)


def test_the_ranks_off_the_majority_and_the_first_layer_are_named() -> None:
    rows = [row(g, 0, 1.0) for g in range(4)] + [row(g, 1, 2.0) for g in range(4)]
    rows[1 + 4] = row(1, 1, math.nextafter(2.0, 3.0))  # rank 1, layer 1: one ULP off
    rows[3] = row(3, 0, 1.5)  # rank 3, layer 0
    (v,) = replica_verdicts(FingerprintEvidence(ranks=4, mismatch=rows), "ddp", POLICY)
    ev = v.evidence
    assert (ev["step"], ev["layer"], ev["ranks"], ev["layers_differing"]) == (7, "l0", [1, 3], 2)
    assert v.scope == {"global_rank": 3} and ev["majority"] is True and ev["majority_ranks"] == [0, 1, 2]
    assert ev["found"]["3"]["param_norm"] == 1.5 and ev["expected"]["param_norm_hex"] == (1.0).hex()


def test_equal_norms_with_different_bit_sums_are_a_divergence() -> None:
    # One ULP of a small element rounds away in a norm; the bit sum moves by one.
    rows = [row(g, 0, 1.0, bits=11) for g in range(3)] + [row(g, 1, 2.0, bits=11) for g in range(3)]
    rows[3 + 2] = row(2, 1, 2.0, bits=12)
    (v,) = replica_verdicts(FingerprintEvidence(ranks=3, mismatch=rows), "ddp", POLICY)
    ev = v.evidence
    assert (ev["layer"], ev["ranks"]) == ("l1", [2])
    assert ev["expected"]["param_sum"] == 11 and ev["found"]["2"]["param_sum"] == 12


def test_with_bit_sums_norms_that_round_differently_are_no_divergence() -> None:
    # Equal tensors, norms from another CPU's kernel one ULP apart: the bit sums decide.
    rows = [row(0, 0, 1.0, bits=11), row(1, 0, math.nextafter(1.0, 2.0), 0.5, bits=11)]
    assert replica_verdicts(FingerprintEvidence(ranks=2, mismatch=rows), "ddp", POLICY) == []
    rows[1] = row(1, 0, 1.0, nonfinite=3, bits=11)  # the non-finite count still counts
    (v,) = replica_verdicts(FingerprintEvidence(ranks=2, mismatch=rows), "ddp", POLICY)
    assert v.evidence["ranks"] == [1]


def test_two_ranks_have_no_majority_and_other_parallelisms_are_not_replicas() -> None:
    found = FingerprintEvidence(ranks=2, mismatch=[row(0, 0, 1.0), row(1, 0, 1.25)])
    (v,) = replica_verdicts(found, "ddp", POLICY)
    assert v.evidence["majority"] is False and v.evidence["ranks"] == [1] and "(no majority)" in v.why
    assert replica_verdicts(found, "fsdp2", POLICY) == [] and replica_verdicts(found, "single", POLICY) == []
    assert replica_verdicts(None, "ddp", POLICY) == []


def test_nan_equals_nan_between_replicas() -> None:
    nan = float("nan")
    found = FingerprintEvidence(ranks=2, mismatch=[row(0, 0, nan, nan, 3), row(1, 0, nan, nan, 3)])
    assert replica_verdicts(found, "ddp", POLICY) == []


def test_grad_nonfinite_names_the_first_rank_and_layer() -> None:
    rows = [row(2, 3, 1.0, float("nan"), 5, step=9), row(1, 4, 1.0, float("inf"), 1, step=9),
            row(1, 2, 1.0, float("nan"), 2, step=9)]
    (v,) = nonfinite_grad_verdicts(FingerprintEvidence(ranks=3, nonfinite=rows), POLICY)
    ev = v.evidence
    assert (ev["step"], ev["global_rank"], ev["layer"], ev["grad_nonfinite"]) == (9, 1, "l2", 2)
    assert ev["layers"] == ["l2", "l4"] and ev["ranks"] == [1, 2]


def test_compare_takes_the_earliest_step_then_the_first_layer_within_the_tolerance() -> None:
    a = {(0, 0, "l0", 0): {1: (1.0, 1.0, 0, 5), 2: (1.0, 1.0, 0, 5)},
         (0, 1, "l1", 0): {1: (2.0, 1.0, 0, 5), 2: (2.0, 1.0, 0, 5)}}
    b = {(0, 0, "l0", 0): {1: (1.0, 1.0, 0, 5), 2: (math.nextafter(1.0, 2.0), 1.0, 0, 5)},
         (0, 1, "l1", 0): {1: (2.0, 1.0, 0, 5), 2: (2.5, 1.0, 0, 5)}}
    d = compare_fingerprints(a, b)["first_divergence"]
    assert (d["step"], d["layer"], d["ulp_distance"]) == (2, "l0", 1)
    d = compare_fingerprints(a, b, ulp=1)["first_divergence"]
    assert (d["step"], d["layer"], d["metric"]) == (2, "l1", "param_norm")
    assert compare_fingerprints(a, a)["identical"] is True
    b[(0, 0, "l0", 0)][1] = (1.0, 1.0, 4, 5)  # only the non-finite count differs, at step 1
    d = compare_fingerprints(a, b, ulp=10)["first_divergence"]
    assert (d["step"], d["metric"]) == (1, "grad_nonfinite")


def test_compare_bitwise_sees_the_bit_sums_and_counts_float32_ulps() -> None:
    one_up = float(np.nextafter(np.float32(1.0), np.float32(2.0)))  # one float32 ULP: 2**29 float64 ones
    a = {(0, 0, "l0", None): {1: (1.0, 1.0, 0, 5), 2: (1.0, 1.0, 0, 5)}}
    b = {(0, 0, "l0", None): {1: (1.0, 1.0, 0, 5), 2: (1.0, 1.0, 0, 6)}}
    d = compare_fingerprints(a, b)["first_divergence"]
    assert (d["step"], d["metric"], d["a"]["param_sum"], d["b"]["param_sum"]) == (2, "param_sum", 5, 6)
    assert "equal norms, different bits" in format_fingerprints(compare_fingerprints(a, b))
    assert compare_fingerprints(a, b, ulp=1)["identical"] is True  # a tolerance is on the norms only
    b[(0, 0, "l0", None)][2] = (one_up, 1.0, 0, 5)
    assert compare_fingerprints(a, b)["first_divergence"]["ulp_distance"] == 1
    assert compare_fingerprints(a, b, ulp=1)["identical"] is True
    a[(0, 0, "l0", None)][2] = (1.0, 1.0, 0, None)  # a run from before bit sums: norms alone
    assert compare_fingerprints(a, {(0, 0, "l0", None): {2: (1.0, 1.0, 0, 7)}})["identical"] is True


def test_the_read_layer_adds_fsdp2_shards_squares_and_reads_nan(tmp_path: Path) -> None:
    db = tmp_path / "fp.db"
    migrate(str(db))
    con = sqlite3.connect(db)
    for g in (0, 1):
        con.execute("INSERT INTO ranks (rank_id, sender, session, attempt, global_rank) VALUES (?, ?, 's', 0, ?)",
                    (g + 1, f"s{g}", g))
    # The weight's shards' bit sums wrap past int32 when added: the full sum is theirs mod 2**32.
    rows = [(1, 5, 0, 0, "w", 3.0, 1.0, 0, 1, 2**31 - 1), (2, 5, 0, 0, "w", 4.0, "NaN", 2, 1, 2),
            (1, 5, 0, 1, "b", 1.0, 1.0, 0, 0, 9), (2, 5, 0, 1, "b", 1.0, 1.0, 0, 0, 9)]
    con.executemany("INSERT INTO fingerprints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    run = RunRef("s", 0)
    found = fingerprints.evidence(con, run)
    assert found is not None and found.mismatch == []  # no model row says DDP: not replicas
    con.executemany("INSERT INTO models (rank_id, model_id, name, parallelism) VALUES (?, 0, 'Net', 'ddp')",
                    [(1,), (2,)])
    con.commit()
    run = RunRef("s", 0)
    series = fingerprints.series(con, run)
    param, grad, nonfinite, bits = series[(0, 0, "w", None)][5]
    assert param == 5.0 and math.isnan(grad) and nonfinite == 2 and bits == -(2**31) + 1  # type: ignore[arg-type]
    assert series[(0, 1, "b", 0)][5] == (1.0, 1.0, 0, 9) and series[(0, 1, "b", 1)][5] == (1.0, 1.0, 0, 9)
    found = fingerprints.evidence(con, run)
    assert found is not None and found.ranks == 2
    assert {r.layer for r in found.mismatch} == {"w", "b"}  # shards differ: the first step with a disagreement
    assert [(r.global_rank, r.layer) for r in found.nonfinite] == [(1, "w")]
    later = fingerprints.evidence(con, run, since_step=6)  # a live window past step 5 sees none of it
    assert later is not None and later.mismatch == [] and later.nonfinite == []
    # With bit sums on both ranks: norms one ULP apart and equal sums agree (step 7); equal
    # norms and different sums do not (step 8), that step is the first disagreement.
    con.executemany("INSERT INTO fingerprints VALUES (?, 7, 0, 1, 'b', ?, 1.0, 0, 0, 9)",
                    [(1, 1.0), (2, math.nextafter(1.0, 2.0))])
    con.executemany("INSERT INTO fingerprints VALUES (?, 8, 0, 1, 'b', 1.0, 1.0, 0, 0, ?)", [(1, 9), (2, 10)])
    con.commit()
    found = fingerprints.evidence(con, run, since_step=6)
    assert found is not None and [(r.step, r.global_rank, r.param_sum) for r in found.mismatch] == [
        (8, 0, 9), (8, 1, 10)]
    con.close()
