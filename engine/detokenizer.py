"""Token ids to text for a reply being decoded: text that never splits a UTF-8 character, a token's
own bytes, and the stop strings a reply ends at (or may still grow into)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any


class Detokenizer:
    """Incremental text from token ids that never splits a UTF-8 character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # tokens before this are settled; decode from here for context
        self.read = 0  # text of tokens[prefix:read] was already emitted
        self.text = ""

    def add(self, token: int) -> str:
        """Append a token; return the text it completed ('' while a character is incomplete)."""
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete character: wait for the next token
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += delta
        return delta


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece uses -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes (a piece may hold part of a UTF-8 character, which its text cannot show)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:  # sentencepiece byte fallback
            return bytes([int(byte.group(1), 16)])
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        table = _byte_decoder()
        if "ByteLevel" in type(decoder).__name__ and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if "\u2581" in piece:  # sentencepiece's word marker is a space
            return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first of `stops` begins in `text` (None: none is there)."""
    hits = [text.find(stop) for stop in stops if stop and stop in text]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
