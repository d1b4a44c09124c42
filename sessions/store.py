"""Snapshots of a conversation's cache on disk, indexed in SQLite (DESIGN contract 2).

A snapshot is the cache of a `CacheState` at one token count: every layer's mlx-lm state (an
attention layer's keys / values up to its offset, a recurrent layer's arrays) plus the token ids
themselves, in one safetensors file. The file is written under a temporary name, fsynced and
renamed before its index row is committed, so a row never names a half-written file. A restore
checks size and sha256 first: a missing, truncated or altered file is never loaded, its row is
dropped and the caller prefills instead.

A snapshot is only worth restoring if a fresh prefill would have reached the same state, so each
row also records the prefill boundaries that built it; the manager only asks for snapshots whose
boundaries match its own plan.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import sqlite_utils

from ..engine.backend import CacheState, MLXBackend
from .recovery import recover

Backend = MLXBackend  # or engine.torch_backend.TorchBackend: both turn caches into arrays and back

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when what a snapshot file holds, or how, changes
FORMAT = "agentfold-snapshot"
DEFAULT_BUDGET = 8 << 30
DEFAULT_HOT_BYTES = 512 << 20


class SnapshotError(Exception):
    """A snapshot cannot be written or restored; the message is the reason reported."""


def default_home() -> Path:
    return Path(os.environ.get("AGENTFOLD_HOME") or "~/.local/share/agentfold").expanduser()


def tokens_sha(tokens: Sequence[int]) -> str:
    """sha256 of token ids as little-endian int32 (the same bytes as `engine.decode.token_sha`)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


# --- the store ----------------------------------------------------------------------------------


@dataclass
class _Hot:
    arrays: dict[str, mx.array]
    layout: list[dict[str, Any]]
    nbytes: int
    stamp: tuple[int, int, int]  # the file's (inode, size, mtime_ns) when it was verified


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


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


class SnapshotStore:
    """Snapshot files under `home/snapshots`, rows in `home/index.db`, a small in-memory LRU.

    One writer connection (WAL mode) guarded by a lock; each thread reads on its own connection.
    """

    def __init__(self, home: str | Path | None = None, budget_bytes: int | None = DEFAULT_BUDGET,
                 hot_bytes: int = DEFAULT_HOT_BYTES) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.dir = self.home / "snapshots"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.home / "index.db"
        self.budget_bytes = budget_bytes
        self.hot_bytes = hot_bytes
        self._hot: OrderedDict[str, _Hot] = OrderedDict()
        self._lock = threading.RLock()
        self._local = threading.local()
        self._writer = sqlite_utils.Database(self._connect())
        self._writer.enable_wal()
        with self._writer.conn:
            for name, columns in SCHEMA.items():
                self._writer[name].create(columns, pk="id", if_not_exists=True)
            self._writer["snapshots"].create_index(["key", "tokens_hash"], if_not_exists=True)
            self._writer["turns"].create_index(["session_id"], if_not_exists=True)
            self._writer["turns"].create_index(["snapshot_id"], if_not_exists=True)
        self.recovered = recover(self)  # crash debris: temp files, unindexed files, rows without a file

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, timeout=30, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    @contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """The writer connection, in one transaction."""
        with self._lock, self._writer.conn:
            yield self._writer

    @property
    def read(self) -> sqlite_utils.Database:
        """This thread's reader connection."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite_utils.Database(self._connect())
        return db

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return list(self.read.query(sql, params))

    def row(self, snapshot_id: str) -> dict[str, Any] | None:
        found = self.rows("select * from snapshots where id = ?", [snapshot_id])
        return found[0] if found else None

    def total_bytes(self) -> int:
        return int(self.rows("select coalesce(sum(bytes), 0) as n from snapshots")[0]["n"])

    # --- write ---

    def save(self, key: str, cache: CacheState, boundaries: Sequence[int], parent: str | None = None, *,
             backend: Backend) -> str:
        """Write `cache` (built on the prefill `boundaries` below its length); returns its id.

        The id is a hash of key, tokens and boundaries, so the same state is stored once.
        """
        tokens_hash = tokens_sha(cache.tokens)
        plan = json.dumps(list(boundaries))
        snapshot_id = hashlib.sha256(f"{key}:{tokens_hash}:{plan}".encode()).hexdigest()[:32]
        now = time.time()
        existing = self.row(snapshot_id)
        if existing is not None and _stamp(self.dir / existing["file"]) is not None:
            with self.write() as db:
                db["snapshots"].update(snapshot_id, {"last_used": now})
            return snapshot_id
        try:
            arrays, layout = backend.cache_to_arrays(cache)
        except ValueError as error:
            raise SnapshotError(str(error)) from error
        metadata = {"format": FORMAT, "layout_version": str(LAYOUT_VERSION), "key": key,
                    "layers": json.dumps(layout), "boundaries": plan}
        name = f"{snapshot_id}.safetensors"
        temp = self.dir / f".{snapshot_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.safetensors"
        try:
            mx.save_safetensors(str(temp), arrays, metadata=metadata)
            with open(temp, "r+b") as handle:
                data = handle.read()
                os.fsync(handle.fileno())
            os.replace(temp, self.dir / name)
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        row = {"id": snapshot_id, "key": key, "tokens_hash": tokens_hash, "token_count": cache.length,
               "boundaries": plan, "parent": parent, "bytes": len(data), "file": name,
               "checksum": hashlib.sha256(data).hexdigest(), "created": now, "last_used": now, "hits": 0,
               "pinned": existing["pinned"] if existing else 0}
        with self.write() as db:
            db["snapshots"].insert(row, replace=True)
        self._remember(snapshot_id, data, layout)
        return snapshot_id

    def remove(self, snapshot_id: str) -> None:
        """Drop a snapshot's row, file and hot copy; turns that named it keep no snapshot."""
        row = self.row(snapshot_id)
        with self.write() as db:
            db["snapshots"].delete_where("id = ?", [snapshot_id])
            db.execute("update turns set snapshot_id = null where snapshot_id = ?", [snapshot_id])
        self._hot.pop(snapshot_id, None)
        if row is not None:
            (self.dir / row["file"]).unlink(missing_ok=True)

    def pin(self, snapshot_id: str, pinned: bool = True) -> None:
        with self.write() as db:
            db["snapshots"].update(snapshot_id, {"pinned": int(pinned)})

    def evict(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove least recently used snapshots until the total fits the budget.

        Never removes a pinned snapshot, one a pinned session's turns name, or one in `keep`.
        """
        if self.budget_bytes is None:
            return []
        total = self.total_bytes()
        if total <= self.budget_bytes:
            return []
        protected = set(keep) | {r["snapshot_id"] for r in self.rows(
            "select t.snapshot_id from turns t join sessions s on s.id = t.session_id "
            "where s.pinned = 1 and t.snapshot_id is not null")}
        evicted = []
        for row in self.rows("select id, bytes from snapshots where pinned = 0 order by last_used, created"):
            if total <= self.budget_bytes:
                break
            if row["id"] in protected:
                continue
            self.remove(row["id"])
            total -= row["bytes"]
            evicted.append(row["id"])
        return evicted

    # --- read ---

    def candidates(self, key: str, prompt: Sequence[int], boundaries: Sequence[int]) -> tuple[list[dict], int]:
        """Rows whose tokens are `prompt[:b]` for a boundary b of this plan, built on the same
        boundaries below b, longest first; and the longest such prefix stored under other keys."""
        hashes = {tokens_sha(prompt[:b]): b for b in boundaries}
        if not hashes:
            return [], 0
        marks = ",".join("?" * len(hashes))
        found = self.rows(f"select * from snapshots where tokens_hash in ({marks})", list(hashes))
        usable, other_key = [], 0
        for row in found:
            b = hashes[row["tokens_hash"]]
            if row["token_count"] != b:
                continue
            if row["key"] != key:
                other_key = max(other_key, b)
            elif json.loads(row["boundaries"]) == [x for x in boundaries if x < b]:
                usable.append(row)
        usable.sort(key=lambda r: (r["token_count"], r["last_used"]), reverse=True)
        return usable, other_key

    def load(self, row: dict[str, Any], backend: Backend) -> CacheState:
        """The cache of a snapshot row, verified first; raises SnapshotError with the reason."""
        path = self.dir / row["file"]
        hot = self._hot.get(row["id"])
        if hot is not None and hot.stamp == _stamp(path):
            self._hot.move_to_end(row["id"])
            arrays, layout = hot.arrays, hot.layout
        else:
            self._hot.pop(row["id"], None)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise SnapshotError(f"snapshot {row['id']}: file missing") from None
            if len(data) != row["bytes"]:
                raise SnapshotError(f"snapshot {row['id']}: file truncated ({len(data)} of {row['bytes']} bytes)")
            if hashlib.sha256(data).hexdigest() != row["checksum"]:
                raise SnapshotError(f"snapshot {row['id']}: checksum mismatch")
            arrays, layout = self._remember(row["id"], data)
        try:
            cache = backend.arrays_to_cache(arrays, layout)
        except ValueError as error:
            raise SnapshotError(f"snapshot {row['id']}: {error}") from error
        if cache.length != row["token_count"] or tokens_sha(cache.tokens) != row["tokens_hash"]:
            raise SnapshotError(f"snapshot {row['id']}: tokens do not match its index row")
        with self.write() as db:
            db.execute("update snapshots set hits = hits + 1, last_used = ? where id = ?", [time.time(), row["id"]])
        return cache

    def _remember(self, snapshot_id: str, data: bytes,
                  layout: list[dict[str, Any]] | None = None) -> tuple[dict[str, mx.array], list[dict[str, Any]]]:
        """Parse verified file bytes into arrays and keep them in the hot LRU (within its bytes)."""
        try:
            arrays, metadata = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            mx.eval(list(arrays.values()))
        except Exception as error:  # noqa: BLE001  (any parse failure means: do not use it)
            raise SnapshotError(f"snapshot {snapshot_id}: unreadable ({error})") from error
        if metadata.get("format") != FORMAT or metadata.get("layout_version") != str(LAYOUT_VERSION):
            raise SnapshotError(f"snapshot {snapshot_id}: not a layout {LAYOUT_VERSION} snapshot")
        layout = layout if layout is not None else json.loads(metadata["layers"])
        stamp = _stamp(self.dir / f"{snapshot_id}.safetensors")
        if stamp is not None and len(data) <= self.hot_bytes:
            self._hot[snapshot_id] = _Hot(arrays, layout, len(data), stamp)
            self._hot.move_to_end(snapshot_id)
            while sum(h.nbytes for h in self._hot.values()) > self.hot_bytes:
                self._hot.popitem(last=False)
        return arrays, layout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
