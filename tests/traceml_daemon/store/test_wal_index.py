"""Reading the WAL-index head leaves SQLite's locks on the ``-shm`` file in place: in a
process with the WAL open (a unit check, then the real daemon under ingest with
readers in other processes), another process never finds itself the WAL's only user."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support.procs import DaemonProcess
from tests.traceml_daemon.store.test_checkpointer import _commit_pages, _wal_db
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, count_steps, peers_for, steps_body
from traceml_daemon.store import wal_index
from traceml_daemon.store.checkpointer import Checkpointer
from traceml_wire import messages

# SQLite's unix VFS: the "dead man switch" byte of the -shm file, on which every process
# with the WAL open holds a shared lock (UNIX_SHM_DMS = (22 + 8) * 4 + 8).
_DMS_BYTE = 128

_TRY_DMS_EXCLUSIVE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(sys.argv[2]))
except OSError:
    sys.exit(3)  # held by another process, as it should be
sys.exit(0)
"""


def _another_process_could_reset_the_wal_index(db: Path) -> bool:
    """Whether another process would find itself the WAL's only user: with the dead man
    switch free, it truncates and rebuilds the -shm file under the other's mapping."""
    code = subprocess.run([sys.executable, "-c", _TRY_DMS_EXCLUSIVE, f"{db}-shm", str(_DMS_BYTE)]).returncode
    assert code in (0, 3), code
    return code == 0


def test_reading_the_head_keeps_sqlites_locks_and_gives_the_descriptor_back_once_the_file_goes(
    tmp_path: Path,
) -> None:
    """Closing any descriptor of a file drops every POSIX lock the process holds on it,
    SQLite's included: the head is read through a descriptor kept while the file lives."""
    path = tmp_path / "w.db"
    conn = _wal_db(path)
    _commit_pages(conn)
    assert not _another_process_could_reset_the_wal_index(path)
    held = wal_index.descriptors_held()
    for _ in range(3):
        assert wal_index.read_head(str(path), 132) is not None
    assert wal_index.descriptors_held() == held + 1  # one descriptor, however many reads
    assert not _another_process_could_reset_the_wal_index(path)
    ckpt = Checkpointer(str(path), interval_s=0.01, frames=1)
    ckpt.start()
    time.sleep(0.2)
    ckpt.stop()
    assert ckpt.runs >= 1
    _commit_pages(conn)
    assert not _another_process_could_reset_the_wal_index(path)
    wal_index.release_unnamed()
    assert wal_index.descriptors_held() == held + 1  # still named: SQLite may lock it
    conn.close()  # the last connection: SQLite removes the -shm file
    wal_index.release_unnamed()
    assert wal_index.descriptors_held() == held


def test_no_head_without_a_wal_index_file(tmp_path: Path) -> None:
    assert wal_index.read_head(str(tmp_path / "none.db"), 132) is None


def test_the_daemon_keeps_the_wal_index_while_other_processes_read_beside_it(tmp_path: Path) -> None:
    """Readers in this process open and close connections while the daemon ingests; the
    daemon's lock stays held throughout, every acknowledged step is stored and it exits 0."""
    db = tmp_path / "run.db"
    batches, per_batch = 40, 25
    with DaemonProcess(db) as daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            for seq in range(1, batches + 1):
                body = steps_body((seq - 1) * per_batch, per_batch)
                c.rbatch(seq, [[agent_sender("s1", 0), seq, body]], peers_for(0))
                assert c.recv() == {"t": "ack", "seq": seq}
                assert count_steps(db) == seq * per_batch  # a fresh reader connection each time
                if seq % 10 == 0:
                    assert not _another_process_could_reset_the_wal_index(db)
        assert daemon.stop() == 0
    assert count_steps(db) == batches * per_batch
