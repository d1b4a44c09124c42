"""Prefill cuts of a chat prompt, remembered across the turns of a conversation.

A prompt's plan cuts where its shared head ends, at the start of every assistant message and of
the reply (sessions.manager: `prompt_cuts`), which takes the token ids of each rendered message
prefix. An agent resends its whole history every turn, so without memory each request re-renders
and re-tokenizes every earlier prefix: work that grows with turns x length. Here each prefix's ids
are kept under a digest chained over the messages (and tools) that produced it, so a request
renders only the prefixes it has not seen: its new messages.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from agentfold.sessions.manager import prompt_cuts

Message = dict[str, Any]
MEMO_ENTRIES = 512  # rendered prefixes kept (a 30-turn agent session holds ~30)


class PrefixMemo:
    """Token ids of rendered message prefixes, least recently used dropped first (thread-safe)."""

    def __init__(self, entries: int = MEMO_ENTRIES) -> None:
        self.entries = entries
        self.renders = 0  # prefixes rendered and tokenized (the work the memo saves)
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def encoder(self, encode_head: Callable[[Sequence[Message]], list[int]], messages: Sequence[Message],
                salt: str) -> Callable[[Sequence[Message]], list[int]]:
        """`encode_head` for prefixes of `messages`, answered from memory where it can be.

        `salt` names everything else the rendering depends on (tokenizer, template, tools).
        """
        digests = [hashlib.sha256(salt.encode()).hexdigest()]
        for message in messages:
            text = json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
            digests.append(hashlib.sha256((digests[-1] + text).encode()).hexdigest())

        def encode(head: Sequence[Message]) -> list[int]:
            key = digests[len(head)]
            with self._lock:
                known = self._ids.get(key)
                if known is not None:
                    self._ids.move_to_end(key)
                    return list(known)
            ids = encode_head(head)
            with self._lock:
                self.renders += 1
                self._ids[key] = tuple(ids)
                while len(self._ids) > self.entries:
                    self._ids.popitem(last=False)
            return ids

        return encode


def message_cuts(memo: PrefixMemo, encode_head: Callable[[Sequence[Message]], list[int]],
                 messages: Sequence[Message], prompt: Sequence[int], salt: str) -> tuple[list[int], int]:
    """`prompt_cuts` of `prompt` (its cuts and head), rendering only the prefixes `memo` has not seen."""
    return prompt_cuts(memo.encoder(encode_head, messages, salt), messages, prompt)


_MEMOS: weakref.WeakKeyDictionary[Any, PrefixMemo] = weakref.WeakKeyDictionary()


def memo_for(owner: Any) -> PrefixMemo:
    """The memo of one runtime (one tokenizer and template): created on first use."""
    memo = _MEMOS.get(owner)
    if memo is None:
        memo = _MEMOS.setdefault(owner, PrefixMemo())
    return memo


def tools_salt(tools: Sequence[Any] | None) -> str:
    """The tools' JSON: a template renders them into the system prompt, so they key the memo too."""
    specs = [t.as_openai() if hasattr(t, "as_openai") else t for t in (tools or [])]
    return json.dumps(specs, sort_keys=True, ensure_ascii=False, default=str)
