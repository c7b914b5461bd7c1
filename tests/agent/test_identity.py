"""Identity resolution per launcher, as a pure function of the environment."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from agent import identity as identity_mod
from agent.identity import DistState, agent_sender_id, resolve_identity, session_from_env
from traceml_wire.identity import IDENTITY_NAMES, clean_identity


def resolve(env: dict[str, str], dist: DistState | None = None) -> identity_mod.Identity:
    return resolve_identity(env, dist, hostname="h", pid=4242, ppid=77)


def test_single_process_defaults() -> None:
    ident = resolve({})
    assert (ident.global_rank, ident.local_rank, ident.node_rank) == (0, 0, 0)
    assert (ident.world_size, ident.local_world_size, ident.nnodes) == (1, 1, 1)
    assert ident.session == "local-77" and ident.attempt == 0 and ident.pid == 4242
    assert ident.source == "single"


def test_torchrun_two_nodes() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "job42",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    ident = resolve(env)
    assert (ident.global_rank, ident.local_rank, ident.node_rank) == (5, 1, 1)
    assert (ident.world_size, ident.local_world_size, ident.nnodes) == (8, 4, 2)
    assert ident.session == "job42" and ident.source == "torchrun"


def test_node_rank_accepted_without_group_rank_and_never_from_hostname() -> None:
    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}
    a = resolve_identity(env, hostname="same", pid=1, ppid=1)
    b = resolve_identity({**env, "RANK": "0", "NODE_RANK": "0"}, hostname="same", pid=1, ppid=1)
    assert a.node_rank == 1 and b.node_rank == 0  # two nodes, one hostname


def test_group_rank_wins_over_node_rank() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "NODE_RANK": "9"}
    assert resolve(env).node_rank == 1


def test_torchrun_without_node_variables_derives_node_from_ranks() -> None:
    env = {"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    ident = resolve(env)
    assert ident.node_rank == 1 and ident.nnodes == 2


def test_elastic_restart_sets_attempt_and_keeps_session() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r1",
           "TORCHELASTIC_RESTART_COUNT": "3"}
    ident = resolve(env)
    assert ident.attempt == 3 and ident.session == "r1"
    sender = agent_sender_id(ident, "abc")
    assert sender == "r1/a3/n0/r0/4242-abc"


def test_slurm_srun() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_ID": "991",
    }
    ident = resolve(env)
    assert (ident.global_rank, ident.local_rank, ident.node_rank) == (6, 2, 1)
    assert (ident.world_size, ident.local_world_size, ident.nnodes) == (8, 4, 2)
    assert ident.session == "991" and ident.source == "slurm"


def test_torchrun_under_slurm_prefers_torchrun_ranks() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "55", "RANK": "4", "LOCAL_RANK": "0",
           "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}
    ident = resolve(env)
    assert ident.global_rank == 4 and ident.node_rank == 1 and ident.source == "torchrun"
    assert ident.session == "55"  # run id "none" means "not set": Slurm's job id is next


def test_torch_distributed_overrides_environment() -> None:
    ident = resolve({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, DistState(rank=3, world_size=4))
    assert ident.global_rank == 3 and ident.world_size == 4 and ident.source == "dist"
    assert ident.local_rank == 3 and ident.local_world_size == 4 and ident.node_rank == 0 and ident.nnodes == 1
    assert ident.session == "10.0.0.1:29500"


def test_torch_distributed_with_env_local_layout() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    ident = resolve(env, DistState(rank=3, world_size=4))
    assert (ident.global_rank, ident.local_rank, ident.node_rank) == (3, 1, 1)


def test_garbage_values_fall_back() -> None:
    ident = resolve({"RANK": "x", "WORLD_SIZE": "-3", "LOCAL_RANK": "9"})
    assert ident.world_size == 1 and ident.global_rank == 0 and ident.local_rank == 0


def test_session_precedence_and_sanitizing() -> None:
    assert session_from_env({"TRACEML_SESSION": "my/run x"}, 1) == "my_run_x"
    assert session_from_env({"SLURM_JOB_ID": "5", "TRACEML_SESSION": "t"}, 1) == "5"
    assert session_from_env({"TORCHELASTIC_RUN_ID": "e", "SLURM_JOB_ID": "5"}, 1) == "e"
    assert session_from_env({}, 12) == "local-12"


def test_wire_identity_uses_message_field_names() -> None:
    wire = resolve({}).wire()
    assert wire["session"] == "local-77" and "run_id" not in wire and "source" not in wire
    assert wire["hostname"] == "h" and wire["pid"] == 4242


def test_wire_identity_is_the_declared_fields_and_passes_the_check_unchanged() -> None:
    ident = resolve({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                     "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "2"})
    wire = ident.wire()
    # Every Identity field but the agent's own ``source`` is declared, so none is lost on the wire.
    assert set(wire) == {f.name for f in dataclasses.fields(ident)} - {"source"}
    assert set(wire) <= set(IDENTITY_NAMES)
    cleaned = clean_identity(wire)
    assert cleaned == wire and cleaned.refused == ()


# GROUP_RANK (torchrun), NODE_RANK and SLURM_NODEID name the node; the arithmetic
# global_rank // local_world_size is only the fallback. Uneven layouts (a node with
# fewer GPUs, Slurm's "6,2" tasks per node) make the two disagree.


def test_group_rank_wins_when_it_disagrees_with_the_rank_arithmetic() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "TORCHELASTIC_RUN_ID": "uneven"}
    ident = resolve(env)
    assert 5 // 2 == 2 and ident.node_rank == 1  # not the arithmetic's node 2
    assert (ident.global_rank, ident.local_rank, ident.local_world_size) == (5, 1, 2)
    assert ident.wire()["node_rank"] == 1
    assert agent_sender_id(ident, "ab") == "uneven/a0/n1/r5/4242-ab"


def test_group_rank_wins_over_the_arithmetic_when_torch_distributed_gives_the_ranks() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    ident = resolve(env, DistState(rank=6, world_size=8))
    assert 6 // 2 == 3 and ident.node_rank == 0 and ident.global_rank == 6


def test_group_rank_zero_is_honoured_not_taken_for_absent() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    assert 3 // 2 == 1 and resolve(env).node_rank == 0


def test_slurm_nodeid_wins_when_it_disagrees_with_the_rank_arithmetic() -> None:
    # Node 0 runs 2 tasks and node 1 runs 6: task 6 is node 1's fifth (local id 4),
    # where 6 // 2 (node 0's count) would put it on a node 3 that does not exist.
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "4", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
           "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2,6", "SLURM_JOB_ID": "77"}
    ident = resolve(env)
    assert 6 // 2 == 3 and ident.node_rank == 1 and ident.nnodes == 2
    # This node's own count sizes it, so its local id is kept (not folded to 6 % 2).
    assert (ident.local_rank, ident.local_world_size) == (4, 6)


@pytest.mark.parametrize(
    ("tasks", "node", "expected"),
    [("4(x2),3", "0", 4), ("4(x2),3", "1", 4), ("4(x2),3", "2", 3), ("4(x2),3", "9", 4), ("2,6", "1", 6)],
)
def test_slurm_tasks_per_node_is_read_for_this_node(tasks: str, node: str, expected: int) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NODEID": node, "SLURM_NTASKS": "11", "SLURM_TASKS_PER_NODE": tasks}
    assert resolve(env).local_world_size == expected


@pytest.mark.parametrize(("node", "tasks"), [("1", "4(x99999999999)"), ("99999999999", "4(x2),3"), ("-1", "4(x2),3")])
def test_slurm_tasks_per_node_odd_values_fall_back_without_expanding_the_list(node: str, tasks: str) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NODEID": node, "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": tasks}
    assert resolve(env).local_world_size == 4


def test_dist_state_reads_only_an_already_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 2, get_world_size=lambda: 4
    )
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    assert identity_mod.dist_state() == DistState(rank=2, world_size=4)
    monkeypatch.setattr(fake, "is_initialized", lambda: False)
    assert identity_mod.dist_state() is None
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert identity_mod.dist_state() is None
