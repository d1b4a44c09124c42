"""Snapshots of a conversation's cache on disk, one safetensors file each (DESIGN contract 2).

A snapshot is the cache of a `CacheState` at one token count, as the backend's
`cache_to_arrays` gives it (numpy arrays and a per-layer layout, see `engine.cache_layout`):
every layer's state plus the token ids themselves. The file is written under a temporary name,
fsynced and renamed before its index row (`index.SessionIndex`) is committed, so a row never
names a half-written file. A restore checks size and sha256 first: a missing, truncated or
altered file is never loaded, its row is dropped and the caller prefills instead.

A snapshot is only worth restoring if a fresh prefill would have reached the same state, so each
row also records the prefill boundaries that built it; the manager only asks for snapshots whose
boundaries match its own plan.

Files are standard safetensors, written and read here with the `safetensors` package from numpy
(no MLX). numpy has no bfloat16: in memory a bfloat16 array is its uint16 bits plus a note in its
layer's layout entry, on disk it is tagged BF16, as MLX's writer tagged it, so files written
before this module (by `mx.save_safetensors`) and after it hold the same thing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors
import sqlite_utils

from agentfold.engine.cache_layout import BITS, array_name, mark_bits, split_name
from agentfold.sessions.index import SessionIndex

if TYPE_CHECKING:
    from agentfold.engine.protocol import Backend, CacheState

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1  # bump when what a snapshot file holds, or how, changes
FORMAT = "agentfold-snapshot"
DEFAULT_BUDGET = 8 << 30
DEFAULT_HOT_BYTES = 512 << 20

# safetensors dtype tags numpy can hold (little-endian, as the format is); BF16 comes back as its bits
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "U64": "<u8", "I32": "<i4", "U32": "<u4",
          "I16": "<i2", "U16": "<u2", "I8": "i1", "U8": "u1", "BOOL": "?"}


class SnapshotError(Exception):
    """A snapshot cannot be written or restored; the message is the reason reported."""


def tokens_sha(tokens: Sequence[int]) -> str:
    """sha256 of token ids as little-endian int32 (the same bytes as `engine.decode.token_sha`)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def encode(arrays: Mapping[str, np.ndarray], layout: Sequence[Mapping[str, Any]], metadata: dict[str, str]) -> bytes:
    """safetensors bytes of `arrays`; arrays the layout notes as bfloat16 bits are tagged BF16."""
    tags = {array_name(i, part): dtype for i, spec in enumerate(layout) for part, dtype in spec.get("bits", {}).items()}
    unknown = set(tags.values()) - set(BITS)
    if unknown:
        raise ValueError(f"bits of {sorted(unknown)} are not a dtype snapshots hold")
    dense = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in arrays.items()}
    specs = {name: safetensors.TensorSpec(dtype=tags.get(name, a.dtype.name), shape=a.shape, data_ptr=a.ctypes.data,
                                          data_len=a.nbytes) for name, a in dense.items()}
    return bytes(safetensors.serialize(specs, metadata=metadata))


def decode(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str], list[str]]:
    """The arrays (writable numpy copies), the metadata, and the names of the arrays tagged BF16."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    arrays, bf16 = {}, []
    for name, view in safetensors.deserialize(data):
        tag = view["dtype"]
        if tag not in _NUMPY and tag != "BF16":
            raise ValueError(f"{name}: dtype {tag} is not one a snapshot holds")
        arrays[name] = np.frombuffer(view["data"], dtype=_NUMPY.get(tag, "<u2")).reshape(view["shape"])
        if tag == "BF16":
            bf16.append(name)
    return arrays, metadata, bf16


# --- the store ----------------------------------------------------------------------------------


@dataclass
class _Hot:
    arrays: dict[str, np.ndarray]
    layout: list[dict[str, Any]]
    nbytes: int
    stamp: tuple[int, int, int]  # the file's (inode, size, mtime_ns) when it was verified


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class StagedSnapshot:
    """A cache copied out for writing: `write()` stores it and returns its id (`SnapshotStore.stage`)."""

    store: SnapshotStore
    row: dict[str, Any]
    arrays: dict[str, np.ndarray]
    layout: list[dict[str, Any]]

    @property
    def snapshot_id(self) -> str:
        return self.row["id"]

    def write(self) -> str:
        return self.store._write_staged(self)


class SnapshotStore:
    """Snapshot files under `home/snapshots`, their rows in the session index, a small in-memory LRU."""

    def __init__(self, home: str | Path | None = None, budget_bytes: int | None = DEFAULT_BUDGET,
                 hot_bytes: int = DEFAULT_HOT_BYTES) -> None:
        self.index = SessionIndex(home)  # creates the home and tables, and cleans up crash debris
        self.home, self.dir, self.db_path = self.index.home, self.index.dir, self.index.db_path
        self.recovered = self.index.recovered
        self.budget_bytes = budget_bytes
        self.hot_bytes = hot_bytes
        self._hot: OrderedDict[str, _Hot] = OrderedDict()
        self._hot_lock = threading.Lock()  # the snapshot writer thread adds, the worker reads

        def forget(snapshot_id: str) -> None:
            with self._hot_lock:
                self._hot.pop(snapshot_id, None)

        self.index.on_remove = forget

    # --- the index's rows ---

    def write(self) -> AbstractContextManager[sqlite_utils.Database]:
        """The index's writer connection, in one transaction."""
        return self.index.write()

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self.index.rows(sql, params)

    def row(self, snapshot_id: str) -> dict[str, Any] | None:
        return self.index.row(snapshot_id)

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def remove(self, snapshot_id: str) -> None:
        """Drop a snapshot's row, file and hot copy; turns that named it keep no snapshot."""
        self.index.remove(snapshot_id)

    def pin(self, snapshot_id: str, pinned: bool = True) -> None:
        self.index.pin_snapshot(snapshot_id, pinned)

    # --- write ---

    def save(self, key: str, cache: CacheState, boundaries: Sequence[int], parent: str | None = None, *,
             backend: Backend) -> str:
        """Write `cache` (built on the prefill `boundaries` below its length); returns its id.

        The id is a hash of key, tokens and boundaries, so the same state is stored once.
        """
        staged = self.stage(key, cache, boundaries, parent, backend=backend)
        return staged if isinstance(staged, str) else staged.write()

    def stage(self, key: str, cache: CacheState, boundaries: Sequence[int], parent: str | None = None, *,
              backend: Backend) -> str | StagedSnapshot:
        """The cheap, synchronous half of `save`: the id and a copy of the cache's arrays.

        Returns the id when that state is already stored, else a `StagedSnapshot` whose `write()`
        (serialize, checksum, write, fsync, index row) may run on another thread while the cache
        itself goes on changing.
        """
        tokens_hash = tokens_sha(cache.tokens)
        plan = json.dumps(list(boundaries))
        snapshot_id = hashlib.sha256(f"{key}:{tokens_hash}:{plan}".encode()).hexdigest()[:32]
        existing = self.row(snapshot_id)
        if existing is not None and _stamp(self.dir / existing["file"]) is not None:
            with self.write() as db:
                db["snapshots"].update(snapshot_id, {"last_used": time.time()})
            return snapshot_id
        try:
            arrays, layout = backend.cache_to_arrays(cache)
        except ValueError as error:  # CacheLayoutError: a cache this backend cannot store
            raise SnapshotError(str(error)) from error
        row = {"id": snapshot_id, "key": key, "tokens_hash": tokens_hash, "token_count": cache.length,
               "boundaries": plan, "parent": parent, "pinned": existing["pinned"] if existing else 0}
        return StagedSnapshot(self, row, arrays, layout)

    def _write_staged(self, staged: StagedSnapshot) -> str:
        row = dict(staged.row)
        snapshot_id = row["id"]
        metadata = {"format": FORMAT, "layout_version": str(LAYOUT_VERSION), "key": row["key"],
                    "layers": json.dumps(staged.layout), "boundaries": row["boundaries"]}
        data = encode(staged.arrays, staged.layout, metadata)
        name = f"{snapshot_id}.safetensors"
        temp = self.dir / f".{snapshot_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp.safetensors"
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.dir / name)
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        now = time.time()
        row.update({"bytes": len(data), "file": name, "checksum": hashlib.sha256(data).hexdigest(),
                    "created": now, "last_used": now, "hits": 0})
        with self.write() as db:
            db["snapshots"].insert(row, replace=True)
        self._remember(snapshot_id, data, staged.layout)
        return snapshot_id

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
        with self._hot_lock:
            hot = self._hot.get(row["id"])
            if hot is not None and hot.stamp == _stamp(path):
                self._hot.move_to_end(row["id"])
            else:
                self._hot.pop(row["id"], None)
                hot = None
        if hot is not None:
            arrays, layout = hot.arrays, hot.layout
        else:
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
        except ValueError as error:  # CacheLayoutError: these arrays do not fit this model's cache
            raise SnapshotError(f"snapshot {row['id']}: {error}") from error
        if cache.length != row["token_count"] or tokens_sha(cache.tokens) != row["tokens_hash"]:
            raise SnapshotError(f"snapshot {row['id']}: tokens do not match its index row")
        with self.write() as db:
            db.execute("update snapshots set hits = hits + 1, last_used = ? where id = ?", [time.time(), row["id"]])
        return cache

    def _remember(self, snapshot_id: str, data: bytes, layout: list[dict[str, Any]] | None = None
                  ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """Parse verified file bytes into arrays and keep them in the hot LRU (within its bytes)."""
        try:
            arrays, metadata, bf16 = decode(data)
            current = metadata.get("format") == FORMAT and metadata.get("layout_version") == str(LAYOUT_VERSION)
            if current and layout is None:
                layout = _with_bits(json.loads(metadata["layers"]), bf16)
        except Exception as error:  # noqa: BLE001  (any parse failure means: do not use it)
            raise SnapshotError(f"snapshot {snapshot_id}: unreadable ({error})") from error
        if not current or layout is None:
            raise SnapshotError(f"snapshot {snapshot_id}: not a layout {LAYOUT_VERSION} snapshot")
        stamp = _stamp(self.dir / f"{snapshot_id}.safetensors")
        if stamp is not None and len(data) <= self.hot_bytes:
            with self._hot_lock:
                self._hot[snapshot_id] = _Hot(arrays, layout, len(data), stamp)
                self._hot.move_to_end(snapshot_id)
                while sum(h.nbytes for h in self._hot.values()) > self.hot_bytes:
                    self._hot.popitem(last=False)
        return arrays, layout


def _with_bits(layout: list[dict[str, Any]], bf16: Iterable[str]) -> list[dict[str, Any]]:
    """A file's layout with the bits note for each array it tags BF16 (how MLX wrote them, and we do)."""
    for name in bf16:
        where = split_name(name)
        if where is None:
            raise ValueError(f"array {name!r} is BF16 but names no layer")
        mark_bits(layout[where[0]], where[1], "bfloat16")
    return layout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
