"""Old import path of the snapshot store, kept for callers not yet moved (tests/test_faults.py).

The store is now two modules: `index` (the SQLite session index, no MLX) and `snapshots` (the
safetensors files and their in-memory LRU). Import from those.
"""

from agentfold.sessions.index import default_home
from agentfold.sessions.snapshots import SnapshotError, SnapshotStore

__all__ = ["SnapshotError", "SnapshotStore", "default_home"]
