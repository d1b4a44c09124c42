"""Sessions: conversations by id, KV snapshots on disk, SQLite index, prefill plan.

Names load on first use, so `agentfold.sessions.index` (what `agentfold sessions` needs) can be
imported without the engine, which `SessionManager` brings in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentfold.sessions.index import SessionIndex, SessionsError
    from agentfold.sessions.manager import SessionManager, TurnInfo, snapshot_key
    from agentfold.sessions.snapshots import SnapshotError, SnapshotStore

_HOME = {"SessionIndex": "index", "SessionsError": "index", "SessionManager": "manager", "TurnInfo": "manager",
         "snapshot_key": "manager", "SnapshotError": "snapshots", "SnapshotStore": "snapshots"}

__all__ = ["SessionIndex", "SessionManager", "SessionsError", "SnapshotError", "SnapshotStore", "TurnInfo",
           "snapshot_key"]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
