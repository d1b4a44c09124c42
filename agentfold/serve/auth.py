"""API keys, shared by the HTTP APIs and MCP: kept only as a sha256 digest, compared in constant time.

Hashing first means the comparison always runs over 32 bytes whatever the offered key's length,
so neither the key's length nor its prefix leaks through timing, and the plain key does not sit
in the server's memory (or in a core dump) after start-up.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

KEY_HINT = "send it as 'x-api-key: <key>' or 'Authorization: Bearer <key>'"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKey:
    """One accepted key; `matches` takes the request headers (Bearer token or Anthropic's x-api-key)."""

    __slots__ = ("_digest",)

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self._digest = _digest(key)

    def __repr__(self) -> str:
        return "ApiKey(<hidden>)"

    def matches(self, headers: Mapping[str, str]) -> bool:
        """True when the request offers this key in either header (both are tried)."""
        offered = [headers.get("x-api-key") or ""]
        auth = headers.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
        ok = False
        for candidate in offered:  # no early exit: the work does not depend on which one matched
            ok |= bool(candidate) and hmac.compare_digest(_digest(candidate), self._digest)
        return ok


def api_key(key: str | None) -> ApiKey | None:
    """An ApiKey, or None when no key is configured (then anything goes)."""
    return ApiKey(key) if key else None
