"""Hostile input: the protocol fuzzer against the real daemon, alone and behind a real relay.

A real 2-rank gloo torchrun job traced by the agent and two raw good peers (a relay
and an agent, every step row known) send from 127.0.0.1 beside attacker threads
connecting from other loopback addresses for ~30 s. The invariants are behaviour:
the daemon and relay processes stay up and keep answering a fresh connection with
its challenge, every good step is stored exactly once with its exact values, no
good peer is refused or cut off (or kept 10 s without an ack: a liveness bound, not a
timing figure) by what the attackers do, and peak RSS stays under the cap.
(``bench/fuzz.py`` is the long version; ``--each`` runs every kind alone.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.protocol_fuzzer import KINDS, FuzzConfig, Send, generate, run_fuzz, schedule

FUZZ_S = 30.0
TORCHRUN_STEPS = 200  # 40 ms of collate each: the job runs through the fuzzing
RSS_CAP_MB = 600.0


def _run(tmp_path: Path, with_relay: bool, seed: int) -> None:
    report = run_fuzz(FuzzConfig(duration_s=FUZZ_S, seed=seed, with_relay=with_relay, workdir=tmp_path,
                                 rss_cap_mb=RSS_CAP_MB, torchrun_steps=TORCHRUN_STEPS))
    print(report.text())  # the per-kind figures, shown by pytest on failure
    assert not report.problems, report.failure_message()
    # Every attack kind ran (a fuzzer that exercises nothing passes anything).
    assert set(report.by_kind) == set(KINDS), f"kinds never run: {sorted(set(KINDS) - set(report.by_kind))}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_daemon_alone_survives_the_protocol_fuzzer(tmp_path: Path) -> None:
    _run(tmp_path, with_relay=False, seed=20_251_127)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_daemon_behind_a_relay_survives_the_protocol_fuzzer(tmp_path: Path) -> None:
    _run(tmp_path, with_relay=True, seed=20_251_128)


def test_generator_is_deterministic_per_seed_and_covers_every_kind() -> None:
    """Same seed and index: the same bytes; another seed: other bytes; every kind scheduled once per round."""
    first_round = [item for _, item in zip(range(len(KINDS)), schedule(5, tuple(KINDS)), strict=False)]
    assert [index for index, _ in first_round] == list(range(len(KINDS)))
    assert sorted(kind for _, kind in first_round) == sorted(KINDS)
    light = [k for k in KINDS if k not in ("huge_sender_ids", "many_senders", "many_keys")]
    differs = 0
    for index, kind in enumerate(light):
        for relay in (False, True):
            one = generate(kind, 5, index, relay)
            assert one.kind == kind and (one.steps or one.hello is not None)
            assert one.fingerprint() == generate(kind, 5, index, relay).fingerprint(), kind
            differs += one.fingerprint() != generate(kind, 6, index, relay).fingerprint()
    assert differs > len(light)  # most kinds draw something else under another seed


def test_huge_kinds_are_as_large_as_they_claim() -> None:
    """8 MB sender ids, 20,000 senders and 50,000 keys really go out (and still fit the 16 MiB frame cap)."""
    huge = generate("huge_sender_ids", 1, 0, False)
    many = generate("many_senders", 1, 0, False)
    for script, least in ((huge, 8_000_000), (many, 20_000 * 40)):
        sends = [s for s in script.steps if isinstance(s, Send)]
        assert sends and all(least <= len(s.payload) <= 16 * 1024 * 1024 for s in sends), script.kind
