"""sha256 of a model file, read once per file version: later starts look it up by the file's stat.

A 1.1 GB GGUF takes ~0.7 s to hash here; snapshot keys and the converted-weights cache both need
its digest, so it is remembered in `<cache root>/digests.json` under the file's resolved path,
size, modification time (ns) and inode. Any change to those hashes the file again. A cache that
cannot be written only costs the next start another hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()
_MEMO: dict[str, str] = {}  # this process's digests, by stat key


def cache_root() -> Path:
    """Where AgentFold keeps what it can rebuild ($AGENTFOLD_CACHE, else ~/.cache/agentfold)."""
    base = os.environ.get("AGENTFOLD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentfold")
    return Path(base)


def _stat_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"


def sha256_of(path: str | Path) -> str:
    """The file's sha256 (hex), hashed only when this version of the file was never hashed here."""
    path = Path(path)
    key = _stat_key(path)
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
    store = cache_root() / "digests.json"
    known = _read(store)
    digest = known.get(key)
    if digest is None:
        hasher = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                hasher.update(block)
        digest = hasher.hexdigest()
        known = {k: v for k, v in _read(store).items() if not k.startswith(f"{path.resolve()}|")}
        known[key] = digest
        _write(store, known)
    with _LOCK:
        _MEMO[key] = digest
    return digest


def _read(store: Path) -> dict[str, str]:
    try:
        value = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write(store: Path, known: dict[str, str]) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=store.parent, suffix=".tmp", delete=False) as staging:
            staging.write(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(staging.name, store)
    except OSError:
        pass
