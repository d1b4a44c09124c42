"""Answering HTTP while the model loads, then serving the real app on the same socket.

Loading takes seconds to minutes. A server that binds only afterwards refuses connections all that
time, and a supervisor (or a coding assistant's launcher) cannot tell "still loading" from "dead".
So `agentfold serve` starts uvicorn once, with a `SwitchingApp` in front: until the model is
ready it delegates to `LoadingApp` (/health: 503 `{"status": "loading"}`, every other route: 503
in its API's own error shape, with Retry-After), then to the real app. One bind, one server: no
window in which another process could take the port between two binds.

uvicorn runs the ASGI lifespan of the app it was given, once, at start; the real app's lifespan
(MCP's session manager) is started here when the switch happens and stopped at shutdown.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from agentfold.http.app import error_response
from agentfold.http.errors import ApiError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
RETRY_AFTER_S = 2


class LoadingApp:
    """What the server answers before the model is ready: 503s that say so, in each API's shape."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stage = "starting"  # the loader's last progress line, for /health
        self.began = time.monotonic()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "/")
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if path.rstrip("/") == "/health":
            response = JSONResponse({"status": "loading", "model": self.model, "stage": self.stage,
                                     "loading_seconds": round(time.monotonic() - self.began, 1)},
                                    status_code=503, headers=headers)
        else:
            response = error_response(path, ApiError(
                f"The model {self.model} is still loading; retry in a few seconds.", status=503,
                type="server_error", code="model_loading", headers=headers))
        await response(scope, receive, send)


class _Lifespan:
    """Drives one ASGI app's lifespan protocol (startup now, shutdown later) from inside the loop."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def _reply(self) -> MutableMapping[str, Any]:
        """The app's next lifespan message, or an error if the app returned or raised without one."""
        assert self.task is not None
        getter = asyncio.ensure_future(self.outbox.get())
        await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        error = self.task.exception() if not self.task.cancelled() else None
        return {"type": "lifespan.failed", "message": repr(error) if error else "the app's lifespan ended"}

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.create_task(self.app(scope, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        reply = await self._reply()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the server app failed to start: {reply.get('message') or reply['type']}")

    async def stop(self, timeout: float = 10.0) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._reply(), timeout)
            await asyncio.wait_for(self.task, timeout)
        except (asyncio.TimeoutError, Exception):  # shutting down: a stuck lifespan must not hang the exit
            self.task.cancel()


class SwitchingApp:
    """The one app uvicorn serves: `loading` until `switch(app)` (called from the loading thread)."""

    def __init__(self, loading: ASGIApp) -> None:
        self.current = loading
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._lifespan: _Lifespan | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._serve_lifespan(receive, send)
            return
        await self.current(scope, receive, send)

    async def _serve_lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        self._loop = asyncio.get_running_loop()
        self._started.set()
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        if self._lifespan is not None:
            await self._lifespan.stop()
        await send({"type": "lifespan.shutdown.complete"})

    async def _switch(self, app: ASGIApp) -> None:
        lifespan = _Lifespan(app)
        await lifespan.start()
        self._lifespan = lifespan
        self.current = app

    def switch(self, app: ASGIApp, stopping: threading.Event, timeout: float = 60.0) -> bool:
        """Serve `app` from now on (its lifespan started first); False if the server stopped meanwhile."""
        while not self._started.wait(0.1):
            if stopping.is_set():
                return False
        assert self._loop is not None
        try:
            asyncio.run_coroutine_threadsafe(self._switch(app), self._loop).result(timeout)
        except Exception:  # the loop closed, the future was cancelled or timed out
            if self._loop.is_closed() or stopping.is_set():  # the server stopped while the app started
                return False
            raise
        return True
