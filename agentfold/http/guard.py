"""The checks every HTTP request passes before any route runs: Host, Origin, API key, body size.

- **Host / Origin** (only when listening on loopback): a web page the user visits can make the
  browser talk to 127.0.0.1 (DNS rebinding, or a plain cross-site POST). Browsers always send the
  name they think they reach as `Host`, and an `Origin` on cross-site requests, so a request whose
  Host is not a loopback name (421) or whose Origin is neither loopback nor an opted-in
  `--cors-origin` (403) is refused on every route, not only on `/mcp` (where the mcp SDK checks too).
- **API key**: with a key configured, everything but `/health` needs it (`/mcp`, `/metrics` and
  `/dashboard` included).
- **Body size**: a declared `Content-Length` over the limit is a 413 before a byte is read;
  bodies without one are counted while read (`fields.read_json`, and the SDK's own limit on /mcp).

Answers are in the API's own error shape (`on_error(path, ApiError)`), so clients show the message.
CORS is off unless origins are given: then Starlette's CORSMiddleware answers preflights for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agentfold.http.errors import ApiError
from agentfold.serve.auth import KEY_HINT, ApiKey
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES, is_loopback

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Guard", "GuardConfig", "check", "is_loopback", "middleware"]

OPEN_PATHS = frozenset({"/health"})

ErrorResponder = Callable[[str, ApiError], Response]


def _host_name(value: str) -> str:
    """The name part of a Host header (`[::1]:8080` -> `::1`, `localhost:80` -> `localhost`)."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class GuardConfig:
    """What the guard enforces; `host` is the address the server listens on."""

    host: str = "127.0.0.1"
    api_key: ApiKey | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    cors_origins: tuple[str, ...] = ()
    open_paths: frozenset[str] = field(default=OPEN_PATHS)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def origin_allowed(self, origin: str) -> bool:
        if origin in self.cors_origins or "*" in self.cors_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and is_loopback(parts.hostname or "")


def check(config: GuardConfig, path: str, headers: Headers) -> ApiError | None:
    """The first reason to refuse this request, or None."""
    if config.loopback:
        host = headers.get("host")
        if host and not is_loopback(_host_name(host)):
            return ApiError(f"Host {host!r} is not this server: it listens on loopback and answers only to "
                            "localhost / 127.0.0.1 / [::1] (DNS-rebinding protection).", status=421,
                            code="invalid_host")
        origin = headers.get("origin")
        if origin and not config.origin_allowed(origin):
            return ApiError(f"Requests from origin {origin!r} are refused (cross-site protection); start the "
                            "server with --cors-origin ORIGIN to allow a web app.", status=403,
                            type="permission_error", code="origin_not_allowed")
    if config.api_key is not None and path not in config.open_paths and not config.api_key.matches(headers):
        return ApiError(f"Invalid or missing API key: {KEY_HINT}.", status=401, type="authentication_error",
                        code="invalid_api_key")
    length = headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            return ApiError(f"Content-Length {length!r} is not a byte count.")
        if int(length) > config.max_body_bytes:
            return body_too_large(int(length), config.max_body_bytes)
    return None


def body_too_large(size: int | None, limit: int) -> ApiError:
    said = f"{size} bytes" if size is not None else "larger than that"
    return ApiError(f"The request body is {said}; this server accepts at most {limit} bytes "
                    "(raise it with --max-body-bytes).", status=413, type="invalid_request_error",
                    code="request_too_large")


class Guard:
    """ASGI middleware running `check` on every HTTP request."""

    def __init__(self, app: ASGIApp, config: GuardConfig, on_error: ErrorResponder) -> None:
        self.app = app
        self.config = config
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope.get("path", "")
            error = check(self.config, path, Headers(scope=scope))
            if error is not None:
                await self.on_error(path, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def middleware(config: GuardConfig, on_error: ErrorResponder) -> Sequence[Middleware]:
    """The middleware list for Starlette: CORS first (only when origins are set), then the guard."""
    stack = []
    if config.cors_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                                allow_headers=["*"], expose_headers=["Mcp-Session-Id"]))
    stack.append(Middleware(Guard, config=config, on_error=on_error))
    return stack
