"""Who this process is in the job: ranks, node, session, attempt.

A pure function of an environment mapping plus (optionally) the state of
torch.distributed, so every launcher can be unit-tested without launching.
Precedence for ranks: torch.distributed when initialized, else torchrun's
variables, else Slurm's, else a single process. Node identity comes from
GROUP_RANK / NODE_RANK / SLURM_NODEID (or the rank arithmetic), never from
the hostname: two nodes can share one.

This module must not import torch: the relay and tests use it too, and
``dist_state`` only looks at torch when the training script already did.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from traceml_wire.identity import IDENTITY_FIELDS


@dataclass(frozen=True)
class DistState:
    """What an initialized torch.distributed process group says."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class Identity:
    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    nnodes: int
    hostname: str
    session: str  # run id shared by every rank of one job
    attempt: int  # elastic restart count
    pid: int
    source: str  # "dist" | "torchrun" | "slurm" | "single": which launcher we read

    def wire(self) -> dict[str, Any]:
        """The identity map a hello carries: this identity's fields that
        traceml_wire.identity declares, under their declared names (``source`` is
        the agent's own business; the runtime adds ``parallelism`` once known)."""
        return {name: value for name, value in asdict(self).items() if name in IDENTITY_FIELDS}


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return None


def _slurm_tasks_per_node(env: Mapping[str, str], node_rank: int | None) -> int | None:
    """SLURM_NTASKS_PER_NODE, else this node's count in SLURM_TASKS_PER_NODE
    ("4(x2),3": nodes 0 and 1 run 4 tasks, node 2 runs 3), else its first count."""
    value = _int(env, "SLURM_NTASKS_PER_NODE")
    if value is not None:
        return value
    first: int | None = None
    nodes_before = 0  # nodes covered by the groups already read
    for match in re.finditer(r"(\d+)(?:\(x(\d+)\))?", env.get("SLURM_TASKS_PER_NODE", "")):
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        first = count if first is None else first
        if node_rank is not None and nodes_before <= node_rank < nodes_before + repeat:
            return count
        nodes_before += repeat
    return first


def _sanitize(text: str) -> str:
    # Sender ids use "/" as a separator; keep session text to a safe alphabet.
    return re.sub(r"[^A-Za-z0-9_.:@=+-]", "_", text)[:96]


def session_from_env(env: Mapping[str, str], ppid: int | None = None) -> str:
    """The run id every rank (and relay) of one job agrees on without talking."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id.lower() != "none":
        return _sanitize(run_id)
    for name in ("SLURM_JOB_ID", "TRACEML_SESSION"):
        value = env.get(name, "").strip()
        if value:
            return _sanitize(value)
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if addr and port:
        return _sanitize(f"{addr}:{port}")
    return f"local-{os.getppid() if ppid is None else ppid}"


def resolve_identity(
    env: Mapping[str, str],
    dist: DistState | None = None,
    *,
    hostname: str | None = None,
    pid: int | None = None,
    ppid: int | None = None,
) -> Identity:
    """Resolve the identity; never raises for odd values (falls back instead)."""
    if env.get("RANK") is not None or env.get("LOCAL_RANK") is not None:
        source = "torchrun"
        rank = _first_int(env, "RANK") or 0
        world = _first_int(env, "WORLD_SIZE") or 1
        local_rank = _first_int(env, "LOCAL_RANK")
        local_world = _first_int(env, "LOCAL_WORLD_SIZE")
        node_rank = _first_int(env, "GROUP_RANK", "NODE_RANK")
        nnodes = _first_int(env, "GROUP_WORLD_SIZE", "NNODES")
    elif env.get("SLURM_PROCID") is not None:
        source = "slurm"
        rank = _first_int(env, "SLURM_PROCID") or 0
        world = _first_int(env, "SLURM_NTASKS", "SLURM_NPROCS") or 1
        local_rank = _first_int(env, "SLURM_LOCALID")
        node_rank = _first_int(env, "SLURM_NODEID")
        local_world = _slurm_tasks_per_node(env, node_rank)
        nnodes = _first_int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    else:
        source = "single"
        # Layout unknown: derived below (one node), also when a process group
        # later supplies the ranks (mp.spawn, custom launchers).
        rank, world = 0, 1
        local_rank = local_world = node_rank = nnodes = None

    if dist is not None:
        # The process group is the ground truth for global rank and size
        # (mp.spawn and custom launchers set no torchrun variables).
        source = "dist"
        rank, world = dist.rank, max(1, dist.world_size)

    world = max(1, world)
    rank = min(max(0, rank), world - 1)
    if local_world is None or local_world <= 0:
        local_world = world // nnodes if nnodes and nnodes > 0 and world % nnodes == 0 else world
    local_world = min(local_world, world)
    if local_rank is None or not 0 <= local_rank < local_world:
        local_rank = rank % local_world
    if node_rank is None or node_rank < 0:
        node_rank = rank // local_world
    if nnodes is None or nnodes <= 0:
        nnodes = max(1, -(-world // local_world))  # ceil: uneven Slurm layouts
    attempt = _first_int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    return Identity(
        global_rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world,
        local_world_size=local_world,
        nnodes=nnodes,
        hostname=hostname if hostname is not None else socket.gethostname(),
        session=session_from_env(env, ppid),
        attempt=max(0, attempt),
        pid=os.getpid() if pid is None else pid,
        source=source,
    )


def dist_state() -> DistState | None:
    """torch.distributed's rank and size, if the script already initialized it.

    Looks only at modules already imported, so calling it never pays torch's
    import cost and never initializes CUDA.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return DistState(rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
    except Exception:  # a half-torn-down group, a backend error: fall back to env
        return None


def current_identity(env: Mapping[str, str] | None = None) -> Identity:
    return resolve_identity(os.environ if env is None else env, dist_state())


def agent_sender_id(identity: Identity, rand: str | None = None) -> str:
    """``{session}/a{attempt}/n{node_rank}/r{global_rank}/{pid}-{rand}`` (docs/internals.md).

    Readable in logs, unique per process; an opaque key to the relay and daemon,
    which take identity from the hello (``wire``), never from this string."""
    tail = rand if rand is not None else secrets.token_hex(3)
    return (
        f"{identity.session}/a{identity.attempt}/n{identity.node_rank}/"
        f"r{identity.global_rank}/{identity.pid}-{tail}"
    )
