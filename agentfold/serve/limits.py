"""Serving limits and the loopback test, without heavy imports (the CLI parser reads them).

Defaults: 8 MiB request bodies (a long coding-agent conversation with tool schemas is well under
1 MiB; far larger is a mistake or an attack), 64 requests waiting beyond the decoding ones.
"""

from __future__ import annotations

import ipaddress

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_QUEUE = 64
LOOPBACK_HOST = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost` (names are not resolved: a name is loopback only if it says so)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
