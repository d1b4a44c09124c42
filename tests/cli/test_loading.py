"""The app `agentfold serve` answers with while the model loads, and the switch to the real app.

A real uvicorn server on loopback (tests.helpers.api_helpers.ServerThread) serves a SwitchingApp:
503s in each API's shape first, then a Starlette app whose lifespan must have run.
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

import anthropic
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentfold.cli.loading import LoadingApp, SwitchingApp
from tests.helpers.api_helpers import ServerThread


def test_loading_answers_503_then_the_real_app_serves_on_the_same_socket():
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("started")
        yield
        events.append("stopped")

    async def health(request):
        return JSONResponse({"status": "ok"})

    loading = LoadingApp("tiny-model")
    switching = SwitchingApp(loading)
    server = ServerThread(switching).start()
    try:
        health_loading = httpx.get(server.url + "/health")
        assert health_loading.status_code == 503 and health_loading.json()["status"] == "loading"
        assert health_loading.headers["retry-after"] == "2" and health_loading.json()["model"] == "tiny-model"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as openai_error:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert openai_error.value.status_code == 503 and "still loading" in openai_error.value.body["message"]
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as anthropic_error:
            claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert anthropic_error.value.status_code == 503
        assert anthropic_error.value.body["error"]["type"] == "overloaded_error"

        real = Starlette(routes=[Route("/health", health)], lifespan=lifespan)
        assert switching.switch(real, threading.Event()) and events == ["started"]
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        server.stop()
    assert events == ["started", "stopped"]  # the real app's lifespan was shut down with the server


def test_switch_gives_up_when_the_server_stops_first():
    switching = SwitchingApp(LoadingApp("m"))
    stopping = threading.Event()
    stopping.set()
    assert switching.switch(Starlette(), stopping) is False
