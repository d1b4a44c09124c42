"""Session ids: one strict pattern, checked wherever an id enters from outside (HTTP, MCP, CLI).

Ids only ever reach SQLite as bound parameters and never name a file (snapshot files are named
by a content hash), so this is defence in depth: an id that could be a path (`../../etc/passwd`)
or SQL (`x'; DROP TABLE snapshots;--`) is refused at the door with a message saying what is
allowed, instead of being stored and echoed into logs, telemetry and client configs.
"""

from __future__ import annotations

import hashlib
import re

SESSION_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
RULE = "1-128 characters: letters, digits and . _ : - (starting with a letter or digit)"


def is_session_id(value: object) -> bool:
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None and ".." not in value


def check_session_id(value: object) -> str:
    """`value` if it is a valid session id; else ValueError naming the rule."""
    if not isinstance(value, str):
        raise ValueError(f"a session id must be a string ({RULE}), not {type(value).__name__}")
    if not is_session_id(value):
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise ValueError(f"{shown!r} is not a valid session id: use {RULE}, without '..'")
    return value


def session_id_for_key(key: str) -> str:
    """A valid id for a free-form client key (e.g. Responses' `prompt_cache_key`): itself when valid, else a hash."""
    return key if is_session_id(key) else "key-" + hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()[:32]
