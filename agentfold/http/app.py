"""The Starlette application: routes, request guards (see `guard`), and errors in each API's own shape.

Coding assistants are picky about errors: an OpenAI client expects `{"error": {"message", "type",
"code", "param"}}`, an Anthropic one `{"type": "error", "error": {"type", "message"}}`. Every
route therefore knows its API, and anything that goes wrong (bad JSON, a wrong field, a 404, a
bug) is answered in that shape with a 4xx / 5xx status and a message, never a bare traceback.

With one model served, `model` is not checked: its id, an alias, a Claude model name all reach
the same model (Claude Code and Codex send whatever their configuration names).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from agentfold.chat.plan import PlanError
from agentfold.http import anthropic_api, guard, openai_api, responses_api
from agentfold.http.dashboard import dashboard_routes
from agentfold.http.errors import ApiError
from agentfold.http.fields import read_json
from agentfold.http.guard import GuardConfig
from agentfold.mcp.server import mount_mcp
from agentfold.serve import auth
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service

log = logging.getLogger(__name__)

Handler = Callable[[Any, Request, dict[str, Any]], Awaitable[Response]]


class Server:
    """What the handlers share: the runtime, the optional API key (hashed) and the request limits."""

    def __init__(self, runtime: Runtime, api_key: str | None = None, default_max_tokens: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.runtime = runtime
        self.api_key = auth.api_key(api_key)
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes

    def check_auth(self, request: Request) -> None:
        """With a key configured, `x-api-key` or `Authorization: Bearer` must match; else anything goes."""
        if self.api_key is not None and not self.api_key.matches(request.headers):
            raise ApiError(f"Invalid or missing API key: {auth.KEY_HINT}.", status=401,
                           type="authentication_error", code="invalid_api_key")


def _stages(runtime: Runtime) -> dict[str, Any]:
    """Pipeline stages' time and bytes (`engine.torch.stages`), when the model is split over processes."""
    stats = getattr(runtime.engine.backend, "stage_stats", None)
    return {"stages": stats()} if callable(stats) else {}


def rss_bytes() -> int:
    """This process's resident memory (Linux: /proc; elsewhere the peak), for /health and load tests."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _is_anthropic(path: str) -> bool:
    return path.rstrip("/").endswith("/messages") or "/messages/" in path


def error_response(path: str, error: ApiError) -> JSONResponse:
    response = anthropic_api.anthropic_error(error) if _is_anthropic(path) else openai_api.openai_error(error)
    response.headers.update(error.headers)
    return response


def _endpoint(server: Server, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            server.check_auth(request)
            body = await read_json(request, server.max_body_bytes)
            return await handler(server, request, body)
        except ApiError as error:
            return error_response(request.url.path, error)
        except PlanError as error:  # found in the transport-neutral plan: a 400 here
            return error_response(request.url.path, ApiError.from_plan(error))
        except Exception as error:  # a bug: log it, answer in the API's shape without a traceback
            log.exception("%s failed", request.url.path)
            return error_response(request.url.path, ApiError(f"Internal error: {type(error).__name__}: {error}",
                                                             status=500, type="server_error"))

    return run


def create_app(runtime: Runtime, api_key: str | None = None, default_max_tokens: int | None = None,
               extra_routes: Sequence[BaseRoute] = (), lifespan: Any = None, host: str = "127.0.0.1",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, cors_origins: Sequence[str] = ()) -> Starlette:
    """The HTTP app for one runtime. `extra_routes` come after ours (e.g. /metrics, a Mount of MCP at /).

    `host` is where it listens (loopback turns on the Host / Origin checks of `guard`); with
    `api_key` every route but /health needs it; bodies over `max_body_bytes` get a 413; CORS
    headers are sent only for `cors_origins`.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, not {max_body_bytes}")
    server = Server(runtime, api_key, default_max_tokens, max_body_bytes)
    guard_config = GuardConfig(host=host, api_key=server.api_key, max_body_bytes=max_body_bytes,
                               cors_origins=tuple(cors_origins))
    routes = [*_api_routes(server), *_info_routes(server), *extra_routes]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error},
                    middleware=guard.middleware(guard_config, error_response), lifespan=lifespan)
    app.state.server = server
    app.state.runtime = runtime
    return app


def _api_routes(server: Server) -> list[BaseRoute]:
    """The POST endpoints of the three APIs, each also without its /v1 prefix (base URLs without /v1)."""
    post = {
        "/v1/chat/completions": openai_api.chat_completions,
        "/v1/completions": openai_api.completions,
        "/v1/responses": responses_api.responses,
        "/v1/messages": anthropic_api.messages,
        "/v1/messages/count_tokens": anthropic_api.count_tokens,
    }
    routes: list[BaseRoute] = []
    for path, handler in post.items():
        run = _endpoint(server, handler)
        routes.append(Route(path, run, methods=["POST"]))
        routes.append(Route(path.removeprefix("/v1"), run, methods=["POST"]))
    return routes


def _info_routes(server: Server) -> list[BaseRoute]:
    """The GET routes: the model list (OpenAI, Anthropic and Codex shapes), one model, /health and /."""
    runtime = server.runtime

    async def models(request: Request) -> Response:
        return JSONResponse(openai_api.models(server))

    async def model(request: Request) -> Response:
        listing = openai_api.models(server)
        name = request.path_params["model"]
        entry = next((m for m in listing["data"] if m["id"] == name), None)
        if entry is None:  # any name reaches the one model; describe it under the asked name
            entry = {**listing["data"][0], "id": name}
        return JSONResponse(entry)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": runtime.model_id, "active": runtime.active,
                             "waiting": runtime.waiting, "max_active": runtime.max_active,
                             "max_queue": runtime.max_queue, "rss_bytes": rss_bytes(),
                             "context_length": runtime.context_length, "turns": dict(runtime.counters),
                             "exactness": runtime.engine.exactness.describe(),
                             "lanes": {"width": runtime.lane_width, **runtime.lanes.summary()},
                             **_stages(runtime)})

    async def root(request: Request) -> Response:
        if request.method == "HEAD":
            return Response(status_code=200)
        return JSONResponse({"name": "agentfold", "model": runtime.model_id,
                             "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                           "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/health"]})

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 / 405 (and other HTTPExceptions) in the API's own error shape."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        message = f"No route {request.method} {request.url.path} on this server."
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}."
    else:
        message = getattr(exc, "detail", None) or "HTTP error"
    return error_response(request.url.path, ApiError(message, status=status,
                                                     type="invalid_request_error" if status < 500 else "server_error",
                                                     code="not_found" if status == 404 else None))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %r", request.url.path, exc)
    return error_response(request.url.path, ApiError("Internal server error.", status=500, type="server_error"))


def build_app(service: Service, api_key: str | None = None, default_max_tokens: int | None = None,
              host: str = "127.0.0.1", max_body_bytes: int | None = None, cors_origins: Sequence[str] = ()) -> Starlette:
    """The HTTP app of a service: the APIs, `/metrics` (Prometheus), `/dashboard` and MCP at `/mcp`.

    `host`, `api_key`, `max_body_bytes` and `cors_origins` apply to every route (see `guard`).
    """
    limit = max_body_bytes or DEFAULT_MAX_BODY_BYTES

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    mcp_routes, lifespan = mount_mcp(service, api_key=api_key, host=host, max_body_bytes=limit,
                                     cors_origins=cors_origins)
    return create_app(service.runtime, api_key=api_key, default_max_tokens=default_max_tokens,
                      extra_routes=[Route("/metrics", metrics, methods=["GET"]), *dashboard_routes(service.telemetry),
                                    *mcp_routes], lifespan=lifespan, host=host, max_body_bytes=limit,
                      cors_origins=cors_origins)
