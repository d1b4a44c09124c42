"""The session index: one SQLite file (`home/index.db`) of sessions, turns and snapshot rows.

The server (through `SessionManager` and `SnapshotStore`) and `agentfold sessions` share this one
class, so a fork, pin or delete means the same thing from either side. It imports no MLX, no
numpy and no engine code: the command line lists and edits a home in a blink, next to a running
server (WAL mode, short write transactions; a server that finds a snapshot file gone drops its row
and prefills instead).

Opened with `create=True` (the server) it makes the home, the tables and WAL mode, and cleans up
crash debris (`recovery`); with `create=False` (the command line) a missing home or index is an
empty one, and nothing is created just by looking.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlite_utils

from agentfold.sessions.recovery import Recovery, recover

SCHEMA = {
    "snapshots": {
        "id": str, "key": str, "tokens_hash": str, "token_count": int, "boundaries": str, "parent": str,
        "bytes": int, "file": str, "checksum": str, "created": float, "last_used": float, "hits": int,
        "pinned": int,
    },
    "sessions": {"id": str, "created": float, "last_used": float, "pinned": int, "parent": str, "title": str},
    "turns": {
        "id": str, "session_id": str, "index": int, "prompt_tokens": int, "reply_tokens": int,
        "snapshot_id": str, "created": float,
    },
}


def default_home() -> Path:
    """Sessions, snapshots and telemetry: $AGENTFOLD_HOME, else ~/.local/share/agentfold."""
    return Path(os.environ.get("AGENTFOLD_HOME") or "~/.local/share/agentfold").expanduser()


class SessionsError(ValueError):
    """A user-fixable problem (unknown id, no such turn); the message says which."""


class SessionIndex:
    """Sessions, turns and snapshot rows of one home.

    One writer connection guarded by a lock; each thread reads on its own connection. Snapshot
    files are named by the rows (`dir / row["file"]`) and removed with them; `on_remove` hears of
    each removed snapshot id (the snapshot store drops its in-memory copy).
    """

    def __init__(self, home: str | Path | None = None, *, create: bool = True) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.dir = self.home / "snapshots"
        self.db_path = self.home / "index.db"
        self.create = create
        self.on_remove: Callable[[str], object] | None = None
        self._lock = threading.RLock()
        self._local = threading.local()
        self._writer: sqlite_utils.Database | None = None
        self.recovered = Recovery()
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)
            writer = self._writer = sqlite_utils.Database(self._connect())
            writer.enable_wal()
            with writer.conn:
                for name, columns in SCHEMA.items():
                    writer[name].create(columns, pk="id", if_not_exists=True)
                writer["snapshots"].create_index(["key", "tokens_hash"], if_not_exists=True)
                writer["turns"].create_index(["session_id"], if_not_exists=True)
                writer["turns"].create_index(["snapshot_id"], if_not_exists=True)
            self.recovered = recover(self)  # crash debris: temp files, unindexed files, rows without a file

    @property
    def exists(self) -> bool:
        return self.db_path.is_file()

    def _connect(self) -> sqlite3.Connection:
        if self.create:
            conn = sqlite3.connect(self.db_path, timeout=30, check_same_thread=False)
        else:  # mode=rw: never create an index where there is none
            conn = sqlite3.connect(self.db_path.resolve().as_uri() + "?mode=rw", uri=True, timeout=30,
                                   check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    @contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """The writer connection, in one transaction."""
        with self._lock:
            if self._writer is None:
                self._writer = sqlite_utils.Database(self._connect())
            with self._writer.conn:
                yield self._writer

    @property
    def read(self) -> sqlite_utils.Database:
        """This thread's reader connection."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite_utils.Database(self._connect())
        return db

    def close(self) -> None:
        """Close the writer and this thread's reader (other threads' readers close with them)."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if not self.create and not self.exists:
            return []
        return list(self.read.query(sql, list(params)))

    # --- snapshots ---

    def row(self, snapshot_id: str) -> dict[str, Any] | None:
        found = self.rows("select * from snapshots where id = ?", [snapshot_id])
        return found[0] if found else None

    def total_bytes(self) -> int:
        found = self.rows("select coalesce(sum(bytes), 0) as n from snapshots")
        return int(found[0]["n"]) if found else 0

    def list_snapshots(self) -> list[dict[str, Any]]:
        """Snapshots, most recently used first, with how many sessions and turns name each."""
        return self.rows(
            "select n.*, count(distinct t.session_id) as sessions, count(t.id) as turns from snapshots n "
            "left join turns t on t.snapshot_id = n.id group by n.id order by n.last_used desc")

    def remove(self, snapshot_id: str) -> dict[str, Any] | None:
        """Drop a snapshot's row, then its file; turns that named it keep no snapshot. Returns the row."""
        row = self.row(snapshot_id)
        with self.write() as db:
            db["snapshots"].delete_where("id = ?", [snapshot_id])
            db.execute("update turns set snapshot_id = null where snapshot_id = ?", [snapshot_id])
        if self.on_remove is not None:
            self.on_remove(snapshot_id)
        if row is not None:
            (self.dir / row["file"]).unlink(missing_ok=True)
        return row

    def pin_snapshot(self, snapshot_id: str, pinned: bool = True) -> None:
        with self.write() as db:
            db.execute("update snapshots set pinned = ? where id = ?", [int(pinned), snapshot_id])

    # --- sessions ---

    def has_session(self, session_id: str) -> bool:
        return bool(self.rows("select id from sessions where id = ?", [session_id]))

    def list_sessions(self) -> list[dict[str, Any]]:
        """Sessions, most recently used first, with their turn count and snapshot bytes."""
        return self.rows(
            "select s.*, count(t.id) as turns, coalesce(sum(n.bytes), 0) as bytes from sessions s "
            "left join turns t on t.session_id = s.id left join snapshots n on n.id = t.snapshot_id "
            "group by s.id order by s.last_used desc")

    def resolve(self, session_id: str) -> str:
        """The full id of a session given its id or a unique prefix of it."""
        if not session_id:
            raise SessionsError("a session id is required")
        if self.has_session(session_id):
            return session_id
        escaped = session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        found = self.rows("select id from sessions where id like ? escape '\\'", [escaped + "%"])
        if not found:
            raise SessionsError(f"no session {session_id!r} in {self.home}")
        if len(found) > 1:
            raise SessionsError(f"{session_id!r} matches {len(found)} sessions in {self.home}; give more of the id")
        return found[0]["id"]

    def session(self, session_id: str) -> dict[str, Any]:
        """One row of `list_sessions`."""
        found = [s for s in self.list_sessions() if s["id"] == session_id]
        if not found:
            raise SessionsError(f"no session {session_id!r} in {self.home}")
        return found[0]

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self.rows("select * from turns where session_id = ? order by [index]", [session_id])

    def turns_with_snapshots(self, session_id: str) -> list[dict[str, Any]]:
        """Turns with their snapshot's token count, bytes and pin (None where it is gone)."""
        return self.rows(
            "select t.*, n.token_count as snapshot_tokens, n.bytes as snapshot_bytes, n.pinned as snapshot_pinned "
            "from turns t left join snapshots n on n.id = t.snapshot_id where t.session_id = ? order by t.[index]",
            [session_id])

    def new_session(self, session_id: str, title: str = "", parent: str | None = None,
                    turns: Sequence[dict[str, Any]] = ()) -> str:
        """Insert a session row (and copies of `turns` under it), in one transaction."""
        now = time.time()
        with self.write() as db:
            db["sessions"].insert({"id": session_id, "created": now, "last_used": now, "pinned": 0,
                                   "parent": parent, "title": title})
            if turns:
                db["turns"].insert_all([{**t, "id": uuid.uuid4().hex, "session_id": session_id} for t in turns])
        return session_id

    def record_turn(self, session_id: str, prompt_tokens: int, reply_tokens: int, snapshot_id: str | None) -> int:
        """Append a turn to a session (and mark it used); returns the turn's index."""
        now = time.time()
        with self.write() as db:
            index = db.execute("select count(*) from turns where session_id = ?", [session_id]).fetchone()[0]
            db["turns"].insert({"id": uuid.uuid4().hex, "session_id": session_id, "index": index,
                                "prompt_tokens": prompt_tokens, "reply_tokens": reply_tokens,
                                "snapshot_id": snapshot_id, "created": now})
            db.execute("update sessions set last_used = ? where id = ?", [now, session_id])
        return index

    def fork(self, session_id: str, turn: int) -> str:
        """A new session holding turns 0..`turn` of `session_id`; both share those snapshots."""
        kept = [t for t in self.turns(session_id) if t["index"] <= turn]
        if not kept or kept[-1]["index"] != turn:
            raise SessionsError(f"session {session_id} has no turn {turn}")
        title = self.rows("select title from sessions where id = ?", [session_id])[0]["title"]
        return self.new_session(uuid.uuid4().hex, title, parent=session_id, turns=kept)

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """A pinned session's snapshots are never evicted."""
        with self.write() as db:
            db.execute("update sessions set pinned = ? where id = ?", [int(pinned), session_id])

    def delete(self, session_id: str) -> list[dict[str, Any]]:
        """Delete a session and its turns, and the snapshots no other turn uses (not pinned ones).

        Returns the removed snapshots' rows.
        """
        named = {t["snapshot_id"] for t in self.turns(session_id)} - {None}
        with self.write() as db:
            db["turns"].delete_where("session_id = ?", [session_id])
            db["sessions"].delete_where("id = ?", [session_id])
        removed = []
        for snapshot_id in sorted(named):
            row = self.row(snapshot_id)
            shared = self.rows("select 1 from turns where snapshot_id = ? limit 1", [snapshot_id])
            if row is not None and not shared and not row["pinned"]:
                self.remove(snapshot_id)
                removed.append(row)
        return removed
