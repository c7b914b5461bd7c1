"""Folding rank output: identical lines once across ranks, tracebacks as one entry,
tracebacks and errors first, torch's ``[rankN]: `` prefixes taken off."""

from __future__ import annotations

from traceml_daemon.analysis.output_fold import OutputLine, first_failure, fold, render, split_tracebacks

TB = [
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "    main()",
    "ValueError: bad batch",
]


def _lines(rank: int, texts: list[str], t0: float = 0.0, stream: str = "stdout") -> list[OutputLine]:
    return [OutputLine(rank, t0 + i, stream, i, text) for i, text in enumerate(texts)]


def test_identical_lines_fold_across_ranks_with_count_and_range() -> None:
    lines = [x for r in range(64) for x in _lines(r, ["warning: slow", "step done", "warning: slow"])]
    lines += _lines(70, ["only me"], t0=100)
    entries = fold(lines)
    assert [(e.kind, e.text, e.ranks_text, e.count) for e in entries] == [
        ("warning", "warning: slow", "0-63", 128),
        ("line", "step done", "0-63", 64),
        ("line", "only me", "70", 1),
    ]
    assert render(entries)[0] == "[ranks 0-63 x128] warning: slow"
    assert render(entries)[2] == "[rank 70 x1] only me"


def test_a_traceback_is_one_entry_and_comes_first() -> None:
    lines = _lines(0, ["hello", *TB, "after"], stream="stderr") + _lines(1, ["hello", *TB], t0=10)
    entries = fold(lines)
    assert entries[0].kind == "traceback" and entries[0].text == "\n".join(TB)
    assert entries[0].ranks == {0, 1} and entries[0].count == 2
    assert [e.text for e in entries[1:]] == ["hello", "after"]  # nothing of the traceback repeated
    assert render(entries[:1]) == ["[ranks 0-1 x2] Traceback (most recent call last):",
                                   *(f"    {line}" for line in TB[1:])]


def test_error_lines_come_before_warnings_and_plain_lines() -> None:
    entries = fold(_lines(0, ["plain", "UserWarning: deprecated", "NCCL error: unhandled system error"]))
    assert [e.kind for e in entries] == ["error", "warning", "line"]


def test_torch_rank_prefixes_are_taken_off_so_ranks_fold() -> None:
    lines = [x for r in (0, 1) for x in _lines(r, [f"[rank{r}]: {t}" for t in TB])]
    (entry,) = fold(lines)
    assert entry.kind == "traceback" and entry.text == "\n".join(TB) and entry.ranks == {0, 1}


def test_chained_tracebacks_stay_one_and_the_first_failure_is_the_earliest() -> None:
    chained = [*TB, "", "During handling of the above exception, another exception occurred:", "", *TB[:-1],
               "KeyError: 'x'"]
    tbs, rest = split_tracebacks(_lines(3, [*chained, "bye"], t0=5))
    assert len(tbs) == 1 and tbs[0].exception == "KeyError: 'x'" and [x.line for x in rest] == ["bye"]
    late, _ = split_tracebacks(_lines(1, TB, t0=9))
    assert first_failure([*late, *tbs]) is tbs[0]
    assert first_failure([]) is None
