"""Sessions: conversations by id, KV snapshots on disk, SQLite index, prefill plan."""

from .manager import SessionManager, TurnInfo, snapshot_key
from .store import SnapshotError, SnapshotStore

__all__ = ["SessionManager", "SnapshotError", "SnapshotStore", "TurnInfo", "snapshot_key"]
