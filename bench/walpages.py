"""Which tables and indexes a live database's commits rewrite: its WAL, page by page.

SQLite writes every page a transaction dirtied, whole (4 KiB), to the WAL at commit,
however few bytes changed on it. Write amplification on the daemon's database (tens of
MB/s of WAL for a few MB/s of rows) is therefore a question of which B-trees' pages
each commit touches. This reads the valid frames of the current WAL (those whose salts
match its header, i.e. written since the last checkpoint reset it), maps each frame's
page number to its table or index through the ``dbstat`` virtual table on a read-only
connection, and prints frames and distinct pages per B-tree.

    python bench/walpages.py /tmp/traceml-ingest-*/ingest.db   # while the daemon runs
    python bench/ingest.py --ranks 4096 --relays 64 --modes paced --keep-db  # one to probe

Pages allocated after the ``dbstat`` scan show as ``(new page)``. Needs an sqlite3
built with SQLITE_ENABLE_DBSTAT_VTAB (Debian's and python.org's are). Ends with one
line of JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sqlite3
import struct
import sys
import tempfile
from pathlib import Path

WAL_HEADER = struct.Struct(">IIIIII")  # magic, version, page size, checkpoint seq, salt-1, salt-2
FRAME_HEADER = struct.Struct(">IIII")  # page number, db size after commit (0: not a commit), salts
WAL_HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24


def wal_frames(wal: bytes) -> tuple[list[int], int, int]:
    """(page number of each valid frame, commits, page size) of a WAL file's bytes."""
    if len(wal) < WAL_HEADER_BYTES:
        return [], 0, 0
    magic, _version, page_size, _seq, salt1, salt2 = WAL_HEADER.unpack_from(wal)
    if magic not in (0x377F0682, 0x377F0683) or page_size <= 0:
        raise ValueError("not a WAL file (bad magic or page size)")
    pages: list[int] = []
    commits = 0
    at = WAL_HEADER_BYTES
    while at + FRAME_HEADER_BYTES + page_size <= len(wal):
        page, db_size, s1, s2 = FRAME_HEADER.unpack_from(wal, at)
        if (s1, s2) != (salt1, salt2):
            break  # left over from before the last reset
        pages.append(page)
        commits += db_size != 0
        at += FRAME_HEADER_BYTES + page_size
    return pages, commits, page_size


def page_owners(db: Path) -> dict[int, str]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT pageno, name FROM dbstat"))
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("db", type=Path, help="the database file (its -wal beside it)")
    parser.add_argument("--top", type=int, default=20, help="B-trees to list")
    args = parser.parse_args()
    wal_path = Path(f"{args.db}-wal")
    if not wal_path.exists():
        sys.exit(f"no WAL at {wal_path}: probe a database while its writer runs (WAL mode)")
    with tempfile.NamedTemporaryFile() as copy:  # a still snapshot of a file being written
        shutil.copyfile(wal_path, copy.name)
        pages, commits, page_size = wal_frames(Path(copy.name).read_bytes())
    owners = page_owners(args.db)
    frames = collections.Counter(owners.get(p, "(new page)") for p in pages)
    distinct = collections.Counter(owners.get(p, "(new page)") for p in set(pages))
    total = len(pages)
    print(f"{total} frames ({total * page_size / 2**20:.1f} MiB) in {commits} commits, "
          f"{total / max(commits, 1):.0f} frames per commit")
    for name, n in frames.most_common(args.top):
        print(f"  {n:8d} frames {100 * n / max(total, 1):5.1f}%  {distinct[name]:7d} distinct pages  {name}")
    print(json.dumps({"frames": total, "commits": commits, "page_size": page_size,
                      "frames_by_btree": dict(frames), "pages_by_btree": dict(distinct)}))


if __name__ == "__main__":
    main()
