"""The spool directory is private to the relay's user: made 0700, refused when someone else owns it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from relay.spool_file import Packed, Spool, ensure_private_dir

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_directory_is_0700_and_an_open_one_of_ours_is_narrowed(tmp_path: Path) -> None:
    fresh = tmp_path / "spool" / "session"
    ensure_private_dir(str(fresh))
    assert _mode(fresh) == 0o700
    opened = tmp_path / "opened"
    opened.mkdir(mode=0o755)
    opened.chmod(0o755)
    ensure_private_dir(str(opened))
    assert _mode(opened) == 0o700


@needs_root
def test_directory_owned_by_another_user_is_refused_with_what_to_do(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match="TRACEML_SPOOL_DIR"):
        ensure_private_dir(str(theirs))
    spool = Spool(str(theirs), cap_bytes=1 << 20)
    with pytest.raises(PermissionError):  # the relay warns once and keeps the batch in memory
        spool.append(Packed(seq=1, data=b"x" * 10, n_items=1, body_bytes=10))
    assert list(theirs.iterdir()) == []


@needs_root
def test_folder_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, OTHER_UID, OTHER_UID)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="other users can write"):
        ensure_private_dir(str(shared / "mine"))
    shared.chmod(0o1777)  # like /tmp: others cannot move our folder
    ensure_private_dir(str(shared / "mine"))
    assert _mode(shared / "mine") == 0o700
