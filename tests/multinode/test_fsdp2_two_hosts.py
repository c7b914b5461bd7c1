"""FSDP2 straggler across two simulated hosts (network namespaces): a real 2 nodes x
2 ranks torchrun gloo FSDP2 job (examples/scenarios/fsdp2_straggler.py) whose rank 3
is slow in its own backward, relays forwarding over the veth link to the daemon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multinode.test_two_hosts import REASON, STEPS, _by_rank, _run_job, _start_daemon
from tests.support.netns import Host, two_hosts
from tests.support.procs import EXAMPLES, wait_for_steps

pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as pair:
        yield pair


STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "WAIT_STRAGGLER", "STRAGGLER", "NODE_STRAGGLER"}


def test_fsdp2_slow_rank_on_the_second_host_is_the_only_straggler(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    db = tmp_path / "fsdp2_straggler.db"
    with _start_daemon(hosts, db, tmp_path) as daemon:
        _run_job(hosts, daemon, ["--ms", "40", "--slow-rank", "3"], script=EXAMPLES / "scenarios" / "fsdp2_straggler.py")
        s = wait_for_steps(db, ranks=4, steps=STEPS)
    assert s["topology"]["parallelism"] == "fsdp2" and s["topology"]["nnodes"] == 2
    strag = [v for v in s["verdicts"] if v["name"] in STRAGGLERS]
    assert [(v["name"], v["scope"].get("global_rank")) for v in strag] == [("COMPUTE_STRAGGLER", 3)], s["verdicts"]
    assert strag[0]["evidence"]["phase"] == "backward"
    for r in _by_rank(s):
        assert r["collective_wait_ms_median"]["backward"] is not None, r
        fsdp2 = r["memory"]["fsdp2"]
        assert fsdp2["shard_degree"] == 4 and abs(fsdp2["local_shard_bytes"] - fsdp2["estimated_full_bytes"] / 4) <= (
            0.05 * fsdp2["estimated_full_bytes"]), fsdp2
