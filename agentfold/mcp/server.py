"""MCP server (DESIGN contract 4): generate, check exactness, audit, read telemetry, manage sessions.

Built with the official `mcp` SDK (2.x, `MCPServer`) around one `Service`, so a turn generated over
MCP goes through exactly the path an HTTP turn takes: the same runtime queue, the same session
restore and snapshots, the same telemetry row (api="mcp") and the same audits. The tools
themselves are `agentfold.mcp.tools.ServiceTools` methods; their pydantic results
(`agentfold.mcp.results`) give every tool an `output_schema` and `structured_content` that agents
can read without parsing text. This module registers them and serves them.

`mount_mcp(service)` gives the routes and lifespan that serve the same tools at `/mcp` on the
HTTP server (streamable HTTP, DNS-rebinding protection on for loopback); `agentfold mcp` serves
them over stdio (see `agentfold.cli.ops`).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, TransportSecuritySettings
from mcp.types import ToolAnnotations
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentfold.mcp.tools import ServiceTools
from agentfold.serve.auth import KEY_HINT, ApiKey
from agentfold.serve.limits import is_loopback
from agentfold.serve.service import Service

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
IDEMPOTENT_WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                   open_world_hint=False)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                              open_world_hint=False)


class AgentFoldMCP(MCPServer):
    """The SDK's server, strict about arguments: nothing a client sends is silently dropped.

    An argument no tool parameter takes is a tool error naming it (pydantic would ignore it, so
    `list_snapshots(sesion_id=...)` would list everything), and a value the input schema rejects is
    one readable line (which argument, what is wrong, what was sent) instead of pydantic's
    multi-line report.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_arguments: dict[str, tuple[str, ...]] = {}  # tool name -> the arguments it takes

    def add_checked_tool(self, fn: Callable[..., Any], annotations: ToolAnnotations) -> None:
        """Register `fn` as a tool and remember the argument names it accepts."""
        self.tool(annotations=annotations)(fn)
        self.tool_arguments[fn.__name__] = tuple(
            name for name, parameter in inspect.signature(fn).parameters.items()
            if name not in ("self", "ctx") and parameter.kind is not inspect.Parameter.VAR_KEYWORD)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        known = self.tool_arguments.get(name)
        unknown = sorted(set(arguments) - set(known)) if known is not None else []
        if unknown:
            takes = ", ".join(known) or "no arguments"
            raise ToolError(f"{name}: unknown argument{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(repr(u) for u in unknown)}; it takes: {takes}.")
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as error:
            cause = error.__cause__
            if isinstance(error, UnexpectedToolError) or not isinstance(cause, ValidationError):
                raise
            raise ToolError(readable_validation(name, cause)) from cause


def readable_validation(tool: str, error: ValidationError) -> str:
    """A pydantic report on a tool's arguments as one line: each argument and what is wrong with it."""
    problems: list[str] = []
    for item in error.errors(include_url=False):
        where = _location(item.get("loc", ()))
        if item.get("type") == "missing":
            problem = f"'{where}' is required"
        else:
            message = str(item.get("msg", "is invalid"))
            problem = f"'{where}': {message[:1].lower()}{message[1:]} (got {_short(item.get('input'))})"
        if problem not in problems:
            problems.append(problem)
    return f"{tool}: invalid arguments: {'; '.join(problems)}."


def _location(loc: Sequence[Any]) -> str:
    """('messages', 0, 'role') -> messages[0].role"""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "arguments"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)  # repr escapes newlines: the line stays one line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_mcp(service: Service, name: str = "agentfold") -> MCPServer:
    """The MCP server for one service: tools, and JSON resources for sessions and turns."""
    mcp = AgentFoldMCP(
        name, version=_version(),
        instructions=(f"Local model {service.runtime.model_id} with exact speculative decoding. `generate` replies "
                      "(within a session if you pass session_id); `check_exactness` compares drafted with "
                      "serial decoding; `audit_turn` replays a past turn; turn telemetry, latency summaries "
                      "and session management are here too."),
    )
    tools = ServiceTools(service)
    for tool, hints in (
            (tools.generate, WRITES), (tools.check_exactness, READ_ONLY), (tools.audit_turn, IDEMPOTENT_WRITE),
            (tools.get_turn, READ_ONLY), (tools.list_turns, READ_ONLY), (tools.latency_summary, READ_ONLY),
            (tools.list_sessions, READ_ONLY), (tools.get_session, READ_ONLY), (tools.fork_session, WRITES),
            (tools.pin_session, IDEMPOTENT_WRITE), (tools.delete_session, DESTRUCTIVE),
            (tools.list_snapshots, READ_ONLY)):
        mcp.add_checked_tool(tool, hints)
    mcp.resource("agentfold://sessions/{session_id}", name="session", mime_type="application/json",
                 description="A session: its row, index turns and telemetry rows (JSON).")(tools.session_resource)
    mcp.resource("agentfold://turns/{turn_id}", name="turn", mime_type="application/json",
                 description="One turn's telemetry row (JSON, without inputs and emit_ms).")(tools.turn_resource)
    return mcp


def _version() -> str:
    import agentfold

    return agentfold.__version__


# ---------------------------------------------------------------------------------------------
# Serving over HTTP
# ---------------------------------------------------------------------------------------------

class _RequireKey:
    """ASGI wrapper: with an API key set, MCP requests must carry it like the HTTP APIs' requests.

    (`create_app`'s guard checks it too; this keeps /mcp closed on any app it is mounted on.)
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = ApiKey(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if not self.key.matches(Headers(scope=scope)):
                response = JSONResponse({"error": {"message": f"Invalid or missing API key: {KEY_HINT}.",
                                                   "type": "authentication_error", "code": "invalid_api_key",
                                                   "param": None}}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def mount_mcp(service: Service, api_key: str | None = None, host: str = "127.0.0.1", path: str = "/mcp",
              mcp: MCPServer | None = None, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
              cors_origins: Sequence[str] = ()) -> tuple[list[BaseRoute], Callable[[Any], Any]]:
    """Routes and lifespan that serve the MCP tools at `path` (streamable HTTP) on the HTTP app.

    Pass them to `create_app(runtime, extra_routes=routes, lifespan=lifespan)`. The lifespan runs
    the SDK's session manager (a mounted sub-app's own lifespan would never run). The route is
    the SDK's own `/mcp` endpoint, not a catch-all `Mount("/")`, so other paths keep the HTTP
    app's 404s. `host` is where the server listens: on a loopback address the SDK's DNS-rebinding
    protection is on (other Host headers get 421); on a public one it is off, as the SDK does.
    With `api_key`, MCP requests need it too (x-api-key or Bearer), like the HTTP APIs. Bodies over
    `max_body_bytes` get the SDK's 413; `cors_origins` are allowed origins besides loopback.
    """
    server = mcp or build_mcp(service)
    security = None
    if is_loopback(host):  # the SDK's own rule knows only the three usual spellings of loopback
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1", "127.0.0.1:*", "localhost", "localhost:*", "[::1]", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*", *cors_origins])
    app = server.streamable_http_app(streamable_http_path=path, host=host, transport_security=security,
                                     max_request_body_size=max_body_bytes)
    routes: list[BaseRoute] = []
    for route in app.routes:
        if api_key and isinstance(route, Route) and route.path == path:
            route = Route(path, endpoint=_RequireKey(route.app, api_key))
        routes.append(route)

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        async with server.session_manager.run():
            yield

    return routes, lifespan
