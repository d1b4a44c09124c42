"""Start-up clean-up of a snapshot store after a crash (kill -9, power loss, a full disk).

A snapshot is written to `.ID.PID.RAND.tmp.safetensors`, fsynced, renamed to `ID.safetensors`,
and only then indexed, so a crash can leave three kinds of debris, never a row naming a partial
file: a temporary file (the writer died mid-write), a complete file with no row (it died between
the rename and the commit), or a row whose file is gone or has the wrong size (someone deleted or
truncated it). Restores verify size and sha256 anyway; this pass just keeps the directory and the
index in step so disk use and `list_snapshots` stay honest. It never touches another live
process's temporary file, nor an unindexed file younger than `grace_seconds` (a live writer may be
about to commit its row).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp.safetensors"
GRACE_SECONDS = 60.0
STALE_TEMP_SECONDS = 3600.0


@dataclass
class Recovery:
    """What one start-up pass removed (names of files, ids of rows)."""

    temp_files: list[str] = field(default_factory=list)
    orphan_files: list[str] = field(default_factory=list)
    dropped_rows: list[str] = field(default_factory=list)
    dangling_turns: int = 0

    def __bool__(self) -> bool:
        return bool(self.temp_files or self.orphan_files or self.dropped_rows or self.dangling_turns)


def _writer_pid(name: str) -> int | None:
    """The pid in `.ID.PID.RAND.tmp.safetensors`, or None if the name does not have one."""
    parts = name[: -len(TEMP_SUFFIX)].lstrip(".").split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _age(path: os.DirEntry) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as error:  # read-only directory: leave it, report nothing removed
        log.warning("could not remove %s: %s", path, error)
        return False
    return True


def recover(store: Any, grace_seconds: float = GRACE_SECONDS) -> Recovery:
    """Remove crash debris from `store` (an `index.SessionIndex`): temp files, unindexed files, rows without a file.

    Never raises for a storage problem (a read-only or full disk): it warns and leaves things as they are.
    """
    done = Recovery()
    try:
        _recover(store, grace_seconds, done)
    except (OSError, sqlite3.Error) as error:
        log.warning("snapshot store %s: crash clean-up skipped (%s)", store.dir, error)
    return done


def _recover(store: Any, grace_seconds: float, done: Recovery) -> None:
    rows = {r["file"]: r for r in store.rows("select id, file, bytes from snapshots")}
    with os.scandir(store.dir) as entries:
        files = [e for e in entries if e.is_file() and e.name.endswith(".safetensors")]
    for entry in files:
        if entry.name.endswith(TEMP_SUFFIX):
            pid = _writer_pid(entry.name)
            dead = pid is None or (pid != os.getpid() and not _alive(pid))
            if (dead or _age(entry) > STALE_TEMP_SECONDS) and _unlink(entry.path):
                done.temp_files.append(entry.name)
        elif entry.name not in rows and _age(entry) > grace_seconds and _unlink(entry.path):
            done.orphan_files.append(entry.name)
    present = {e.name: e for e in files}
    for name, row in rows.items():
        entry = present.get(name)
        size = None
        if entry is not None:
            try:
                size = entry.stat().st_size
            except OSError:
                size = None
        if size != row["bytes"]:
            store.remove(row["id"])
            done.dropped_rows.append(row["id"])
    with store.write() as db:
        cursor = db.execute("update turns set snapshot_id = null where snapshot_id is not null and "
                            "snapshot_id not in (select id from snapshots)")
        done.dangling_turns = max(cursor.rowcount, 0)
    if done:
        log.warning("snapshot store %s recovered from an earlier crash: removed %d temporary file(s), "
                    "%d unindexed file(s), %d row(s) without their file; %d turn(s) lost their snapshot",
                    store.dir, len(done.temp_files), len(done.orphan_files), len(done.dropped_rows),
                    done.dangling_turns)
