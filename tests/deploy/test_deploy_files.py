"""deploy/: every file parsed, and its commands run wherever this machine allows.

The daemon command lines of the systemd unit and the container file are run
for real (paths rewritten into a temp dir) so a renamed flag breaks a test,
not a cluster. The Slurm script runs with stub ``scontrol``/``srun`` on PATH;
Kubernetes manifests can only be parsed here.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import EXAMPLES, REPO, DaemonProcess, base_env, free_port, wait_for_steps
from traceml_daemon.commands.cli import build_parser, serve_retention
from traceml_daemon.store.retention import DEFAULT_MAX_DB_MB, DEFAULT_RETENTION_DAYS

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "traceml-daemon.service"
SBATCH = DEPLOY / "slurm" / "traceml.sbatch"
K8S = DEPLOY / "k8s"
CONTAINERFILE = DEPLOY / "Containerfile"
DAEMON_PORT = "29765"
DEFAULT_RETENTION_LOG = (
    f"retention: raw rows kept {DEFAULT_RETENTION_DAYS:g} days, database capped at {DEFAULT_MAX_DB_MB:g} MiB"
)


class ArgvDaemon(DaemonProcess):
    """A daemon started from a deploy file's own argument list."""

    def __init__(self, argv: list[str], db: Path) -> None:
        super().__init__(db)
        self.argv = argv

    def command(self) -> list[str]:
        assert Path(self.argv[0]).name == "traceml-daemon", self.argv
        return [sys.executable, "-m", "traceml_daemon", *self.argv[1:]]


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def replace_flag(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


def serve_bounds(argv: list[str]) -> tuple[float | None, float | None]:
    """The retention a serve command line gets, as serve resolves it (argv from ``serve`` on)."""
    start = argv.index("serve")
    return serve_retention(build_parser("serve").parse_args(argv[start:]))


def assert_default_retention(argv: list[str]) -> None:
    # Every deploy file runs bounded, by serve's own defaults: no flag overrides them.
    assert serve_bounds(argv) == (DEFAULT_RETENTION_DAYS, DEFAULT_MAX_DB_MB), argv
    assert "--keep-everything" not in argv


def run_daemon_argv(argv: list[str], tmp_path: Path) -> None:
    """Start the daemon with ``argv`` (port made free), connect once, stop it cleanly;
    its log states the default retention."""
    port = free_port()
    argv = replace_flag(argv, "--port", str(port))
    db = Path(flag(argv, "--db"))
    daemon = ArgvDaemon(argv, db)
    daemon.port = port
    with daemon:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        rc = daemon.stop()
    assert rc == 0, daemon.log()
    assert db.exists()
    token = Path(flag(argv, "--token-file")).read_text().strip()
    assert token not in daemon.log() and token.encode() not in db.read_bytes()
    assert DEFAULT_RETENTION_LOG in daemon.log(), daemon.log()


def write_token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------- systemd


def read_unit() -> configparser.ConfigParser:
    # systemd allows repeated keys (SystemCallFilter=...); strict=False keeps the last.
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read(UNIT)
    return unit


def test_systemd_unit_parses() -> None:
    unit = read_unit()
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert Path(argv[0]).name == "traceml-daemon" and argv[1] == "serve"
    token_file = flag(argv, "--token-file")
    # The token comes from a credential (LoadCredential, %d) or a root-owned file under /etc/traceml.
    if token_file.startswith("%d/"):
        name, _, source = svc["LoadCredential"].partition(":")
        assert token_file == f"%d/{name}" and source.startswith("/etc/traceml/")
    else:
        assert token_file.startswith("/etc/traceml/")
    assert flag(argv, "--db").startswith(f"%S/{svc['StateDirectory']}/")
    assert flag(argv, "--host") == "0.0.0.0"
    assert_default_retention(argv)
    assert svc["Restart"] == "on-failure"
    hardening = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                 "PrivateTmp": "yes", "DynamicUser": "yes", "CapabilityBoundingSet": ""}
    assert {k: svc.get(k) for k in hardening} == hardening
    assert "AF_INET" in svc["RestrictAddressFamilies"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    # verify checks that ExecStart's binary exists; point it at an executable one.
    exe = Path(sys.executable).with_name("traceml-daemon")
    if not exe.exists():
        exe = tmp_path / "traceml-daemon"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/traceml-daemon", str(exe)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "traceml-daemon.service" not in done.stderr, done.stderr  # no warnings about our unit


def test_systemd_execstart_runs(tmp_path: Path) -> None:
    svc = read_unit()["Service"]
    state, creds = tmp_path / "state", tmp_path / "creds"
    name = svc["LoadCredential"].partition(":")[0]
    write_token(creds / name)
    (state / svc["StateDirectory"]).mkdir(parents=True)
    # %S and %d are what systemd substitutes: the state root and the credentials dir.
    cmdline = svc["ExecStart"].replace("%S", str(state)).replace("%d", str(creds))
    run_daemon_argv(shlex.split(cmdline), tmp_path)


# ---------------------------------------------------------------- Slurm

STUB_SCONTROL = """#!/bin/bash
echo "$*" >> "$STUB_LOG/scontrol.args"
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\\n' $STUB_HOSTS; else exit 1; fi
"""
# srun: record the options and environment, then run the command locally once.
STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_LOG/srun.args"
env | grep '^TRACEML_' | sort > "$STUB_LOG/srun.env" || true
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
exec "$@"
"""
STUB_TORCHRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_LOG/torchrun.args"
env | grep '^TRACEML_' | sort > "$STUB_LOG/torchrun.env" || true
exit "${STUB_TORCHRUN_RC:-0}"
"""
# A daemon stand-in: records its argv, listens on --port until SIGTERM.
STUB_DAEMON = """#!{python}
import json, os, signal, socket, sys
argv = sys.argv[1:]
log = os.environ["STUB_LOG"]
json.dump(argv, open(os.path.join(log, "daemon.args"), "w"))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(argv[argv.index("--port") + 1]))); s.listen()
def stop(*_):
    open(os.path.join(log, "daemon.stopped"), "w").close(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    s.accept()[0].close()
"""


def install_stubs(bin_dir: Path, stubs: dict[str, str]) -> None:
    bin_dir.mkdir()
    for name, text in stubs.items():
        path = bin_dir / name
        path.write_text(text.replace("{python}", sys.executable))
        path.chmod(0o755)


def test_sbatch_syntax() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text


def slurm_env(tmp_path: Path, hosts: str, **extra: str) -> tuple[dict[str, str], Path]:
    log = tmp_path / "log"
    log.mkdir()
    settings = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
                "STUB_HOSTS": hosts, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]",
                "SLURM_JOB_NUM_NODES": "2", "TRACEML_DIR": str(tmp_path / "shared"), "HOME": str(tmp_path)}
    env = base_env(**{**settings, **extra})
    return env, log


def test_sbatch_runs_with_stub_slurm(tmp_path: Path) -> None:
    install_stubs(tmp_path / "bin", {"scontrol": STUB_SCONTROL, "srun": STUB_SRUN, "torchrun": STUB_TORCHRUN,
                                     "fake-daemon": STUB_DAEMON})
    port, rdzv = free_port(), free_port()
    env, log = slurm_env(tmp_path, "node-a node-b", TRACEML_PORT=str(port), RDZV_PORT=str(rdzv),
                         NPROC_PER_NODE="4", TRACEML_DAEMON_CMD="fake-daemon")
    done = subprocess.run(["bash", str(SBATCH), "train.py", "--epochs", "3"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    shared = tmp_path / "shared"
    token = (shared / "token").read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
    assert stat.S_IMODE((shared / "token").stat().st_mode) == 0o600
    assert (log / "scontrol.args").read_text().split("\n")[0] == "show hostnames node-[a-b]"

    daemon_argv = json.loads((log / "daemon.args").read_text())
    assert daemon_argv[0] == "serve"
    assert flag(daemon_argv, "--host") == "0.0.0.0" and flag(daemon_argv, "--port") == str(port)
    assert flag(daemon_argv, "--token-file") == str(shared / "token")
    assert flag(daemon_argv, "--db") == str(shared / "traceml.db")
    assert_default_retention(daemon_argv)
    assert (log / "daemon.stopped").exists()  # SIGTERM at the end of the job

    srun_args = (log / "srun.args").read_text().splitlines()
    assert "--ntasks-per-node=1" in srun_args and "--nodes=2" in srun_args
    torchrun_args = (log / "torchrun.args").read_text().splitlines()
    assert torchrun_args == ["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint=node-a:{rdzv}", "--rdzv-id=4242", "train.py", "--epochs", "3"]
    torchrun_env = dict(line.split("=", 1) for line in (log / "torchrun.env").read_text().splitlines())
    assert torchrun_env["TRACEML_DAEMON"] == f"node-a:{port}"  # the first host of the allocation
    assert torchrun_env["TRACEML_TOKEN"] == token
    # The token reaches torchrun only: not srun's environment, not any command line.
    assert "TRACEML_TOKEN" not in (log / "srun.env").read_text().replace("TRACEML_TOKEN_FILE", "")
    for name in ("srun.args", "torchrun.args", "daemon.args", "scontrol.args"):
        assert token not in (log / name).read_text()


def test_sbatch_stops_daemon_when_training_fails(tmp_path: Path) -> None:
    install_stubs(tmp_path / "bin", {"scontrol": STUB_SCONTROL, "srun": STUB_SRUN, "torchrun": STUB_TORCHRUN,
                                     "fake-daemon": STUB_DAEMON})
    env, log = slurm_env(tmp_path, "node-a node-b", TRACEML_PORT=str(free_port()), STUB_TORCHRUN_RC="3",
                         TRACEML_DAEMON_CMD="fake-daemon")
    done = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert (log / "daemon.stopped").exists()


@pytest.mark.slow
def test_sbatch_real_daemon_and_torchrun(tmp_path: Path) -> None:
    """The script end to end on one "node": real daemon, real torchrun (c10d), real training."""
    install_stubs(tmp_path / "bin", {"scontrol": STUB_SCONTROL, "srun": STUB_SRUN})
    port = free_port()
    env, _ = slurm_env(tmp_path, "127.0.0.1", SLURM_JOB_NUM_NODES="1", TRACEML_PORT=str(port),
                       RDZV_PORT=str(free_port()), NPROC_PER_NODE="2", TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_DAEMON_CMD=f"{sys.executable} -m traceml_daemon",
                       TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    done = subprocess.run(["bash", str(SBATCH), str(EXAMPLES / "train.py"), "--steps", "5"], env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = wait_for_steps(tmp_path / "shared" / "traceml.db", ranks=2, steps=5, timeout=30)
    assert summary["session"] == "4242"  # --rdzv-id is the Slurm job id
    assert sorted(r["global_rank"] for r in summary["ranks"]) == [0, 1]


# ---------------------------------------------------------------- Kubernetes


def load_yaml(name: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    with open(K8S / name) as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def test_k8s_daemon_manifest() -> None:
    docs = by_kind(load_yaml("daemon.yaml"))
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}  # no Secret: created by the user
    dep, svc, pvc = docs["Deployment"], docs["Service"], docs["PersistentVolumeClaim"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    port = container["ports"][0]
    assert port["containerPort"] == int(DAEMON_PORT)
    args = container["args"]
    assert flag(args, "--port") == DAEMON_PORT
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    db_volume = next(n for n, v in volumes.items() if "persistentVolumeClaim" in v)
    assert volumes[db_volume]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert flag(args, "--db").startswith(mounts[db_volume] + "/")
    secret_volume = next(n for n, v in volumes.items() if "secret" in v)
    assert flag(args, "--token-file").startswith(mounts[secret_volume] + "/")
    # The image's ENTRYPOINT (serve) plus these args: bounded by the defaults, and the claim
    # holds the capped database with room to spare for the WAL and the summary.
    assert_default_retention(["serve", "--host", "0.0.0.0", *args])
    storage = pvc["spec"]["resources"]["requests"]["storage"]
    assert storage.endswith("Gi") and int(storage[:-2]) * 1024 >= 1.25 * DEFAULT_MAX_DB_MB, storage
    # Selector and ports line up: the Service reaches the pod's daemon port.
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == int(DAEMON_PORT) and sport["targetPort"] in (port["name"], port["containerPort"])


def test_k8s_pytorchjob_wiring() -> None:
    daemon = by_kind(load_yaml("daemon.yaml"))
    service = daemon["Service"]
    secret = next(v["secret"] for v in daemon["Deployment"]["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    (job,) = load_yaml("pytorchjob.yaml")
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch", role
        env = {e["name"]: e for e in container["env"]}
        assert env["TRACEML_DAEMON"]["value"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
        token = env["TRACEML_TOKEN"]
        assert "value" not in token, "the token must come from the Secret, never inlined"
        ref = token["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["secretName"] and ref["key"] in {i["key"] for i in secret["items"]}


def test_k8s_never_inlines_a_secret() -> None:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_yaml(path.name):
            assert doc["kind"] != "Secret", path


# ---------------------------------------------------------------- Containerfile

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def containerfile_instructions() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word, rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def test_containerfile_parses() -> None:
    instructions = containerfile_instructions()
    assert all(word in INSTRUCTIONS for word, _ in instructions), instructions
    words = [w for w, _ in instructions]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    for required in ("RUN", "USER", "EXPOSE", "ENTRYPOINT"):
        assert required in words
    user = [rest for w, rest in instructions if w == "USER"][-1]
    assert user.split(":")[0] not in {"root", "0"}
    assert [rest for w, rest in instructions if w == "EXPOSE"] == [DAEMON_PORT]
    install = " ".join(rest for w, rest in instructions if w == "RUN")
    assert "--no-deps" in install and "torch" not in install
    for dep in ("uvloop", "msgpack", "aiosqlite", "textual"):
        assert dep in install
    for w, rest in instructions:
        if w == "COPY":
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), src
    entry = json.loads(dict(instructions)["ENTRYPOINT"])
    assert entry[:4] == ["traceml-daemon", "serve", "--host", "0.0.0.0"]
    assert_default_retention(entry + json.loads(dict(instructions)["CMD"]))


def test_containerfile_command_runs(tmp_path: Path) -> None:
    """ENTRYPOINT + CMD as the container would run them, with /data and the secret in a temp dir."""
    instructions = dict(containerfile_instructions())
    argv = json.loads(instructions["ENTRYPOINT"]) + json.loads(instructions["CMD"])
    token = write_token(tmp_path / "token")
    argv = replace_flag(argv, "--token-file", str(token))
    argv = replace_flag(argv, "--db", str(tmp_path / Path(flag(argv, "--db")).name))
    run_daemon_argv(argv, tmp_path)


def _docker_works() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if done.returncode != 0:
        return "docker info failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return None


def test_containerfile_builds() -> None:
    reason = _docker_works()
    if reason:
        pytest.skip(reason)
    done = subprocess.run(["docker", "build", "-f", str(CONTAINERFILE), "-t", "traceml-daemon:test", str(REPO)],
                          capture_output=True, text=True, timeout=290)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_deploy_readme_covers_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in (UNIT, SBATCH, K8S / "daemon.yaml", K8S / "pytorchjob.yaml", CONTAINERFILE):
        assert path.relative_to(DEPLOY).as_posix() in readme, path
