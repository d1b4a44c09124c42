"""The Responses kept for `previous_response_id`: each one's new input items and output items, bounded.

OpenAI's Responses API lets a client send only the new items and name the response they follow;
the server supplies the rest. A response is kept (unless the request said `store: false`) as a link
to its predecessor plus what it added, so a conversation of N turns costs N links, not N copies.
The store is in memory and bounded by count and size, least recently used out first: a chain whose
link is gone (evicted, or the server restarted) is refused as unknown, never served half.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20  # the items' JSON, summed


@dataclass(frozen=True)
class StoredResponse:
    """One response: what it follows, the items it added (its new input, then its output), its session."""

    previous_id: str | None
    items: tuple[dict[str, Any], ...]
    session_id: str | None
    size: int


class ResponseStore:
    """Responses by id, least recently used first out once over `max_responses` or `max_bytes`."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, previous_id: str | None, items: list[dict[str, Any]],
            session_id: str | None) -> None:
        """Keep one response; a response larger than the whole store is not kept (it could not be followed)."""
        size = len(json.dumps(items, ensure_ascii=False, default=str))
        entry = StoredResponse(previous_id, tuple(items), session_id, size)
        with self._lock:
            old = self._entries.pop(response_id, None)
            self._bytes -= old.size if old else 0
            if size > self.max_bytes:
                return
            self._entries[response_id] = entry
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size

    def conversation(self, response_id: str) -> tuple[list[dict[str, Any]], str | None] | None:
        """Every item up to and including `response_id`'s output, and its session; None if any link is gone."""
        with self._lock:
            chain: list[StoredResponse] = []
            seen: set[str] = set()
            current: str | None = response_id
            while current is not None:
                entry = self._entries.get(current)
                if entry is None or current in seen:
                    return None
                seen.add(current)
                chain.append(entry)
                self._entries.move_to_end(current)  # following a response keeps its whole chain alive
                current = entry.previous_id
        items = [item for entry in reversed(chain) for item in entry.items]
        return items, chain[0].session_id
