"""A real uvicorn server on a free loopback port, in a background thread, for the API tests.

The official `openai` and `anthropic` clients talk to it over HTTP exactly as coding assistants
would. One server (and one Runtime) serves every API test module: the fixture is session-scoped
and built on the session-scoped `smollm2_engine`, so the model loads once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from agentfold.http.app import create_app
from agentfold.serve.scheduler import Runtime

MODEL_ID = "SmolLM2-135M-Instruct"


class ServerThread:
    """uvicorn on an already-bound socket, run by a daemon thread; `stop()` shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@dataclass
class ApiServer:
    url: str
    runtime: Runtime

    @property
    def v1(self) -> str:
        return self.url + "/v1"


_shared: dict[str, object] = {"users": 0}


@pytest.fixture(scope="session")
def api_server(smollm2_engine) -> Iterator[ApiServer]:
    """One server for the whole session.

    Each test module imports this fixture, and pytest gives every importing module its own
    instance; the instances share one server (reference-counted), stopped by the last teardown.
    """
    if not _shared["users"]:
        runtime = Runtime(smollm2_engine, MODEL_ID, aliases=("smollm2",), max_active=4)
        server = ServerThread(create_app(runtime)).start()
        _shared.update(runtime=runtime, server=server, api=ApiServer(server.url, runtime))
    _shared["users"] += 1
    try:
        yield _shared["api"]
    finally:
        _shared["users"] -= 1
        if not _shared["users"]:
            _shared["server"].stop()
            _shared["runtime"].close()


def wait_idle(runtime: Runtime, timeout: float = 30.0) -> bool:
    """True once nothing is decoding or queued (a dropped client's turn has been let go)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if runtime.active == 0 and runtime.waiting == 0:
            return True
        time.sleep(0.05)
    return False
