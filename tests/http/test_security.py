"""Security defaults: loopback bind, API keys, DNS-rebinding and CORS, request limits, no pickle.

Real servers on loopback (the full stack: APIs, MCP, /metrics, /dashboard) and the real CLI in
a subprocess for the refusal to bind a public address without a key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from mcp import Client

from agentfold.cli.serve import add_parser, check_limits
from agentfold.http.app import Server
from agentfold.serve.auth import ApiKey
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES
from agentfold.serve.scheduler import Runtime
from tests.helpers.api_helpers import MODEL_ID, wait_idle
from tests.helpers.reliability_helpers import assert_api_error, service_server

pytestmark = pytest.mark.anyio

KEY = "s3cret-key"
HI = [{"role": "user", "content": "Hi"}]
ROOT = Path(__file__).resolve().parents[2]
CODE = [p for folder in ("agentfold", "engine", "kernels", "sessions") for p in (ROOT / folder).rglob("*.py")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


# ---------------------------------------------------------------------------------------------
# Binding and keys
# ---------------------------------------------------------------------------------------------

def test_public_bind_needs_a_key(monkeypatch):
    monkeypatch.delenv("AGENTFOLD_API_KEY", raising=False)
    assert parse().host == "127.0.0.1" and parse().max_body_bytes == DEFAULT_MAX_BODY_BYTES == 8 << 20
    done = subprocess.run([sys.executable, "-m", "agentfold.cli", "serve", "--host", "0.0.0.0", "--port", "18089"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "AGENTFOLD_API_KEY"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "refusing to listen on 0.0.0.0 without an API key" in lines[0] and "--api-key" in lines[0]
    with pytest.raises(ValueError, match="without an API key"):
        check_limits(parse("--host", "192.168.1.5"))
    check_limits(parse("--host", "0.0.0.0", "--api-key", KEY))  # a key makes it acceptable
    check_limits(parse("--host", "127.0.0.2"))  # any loopback address is fine without one
    monkeypatch.setenv("AGENTFOLD_API_KEY", KEY)
    assert parse("--host", "0.0.0.0").api_key == KEY  # the key need not be on the command line
    check_limits(parse("--host", "0.0.0.0"))


def test_keys_are_kept_hashed(smollm2_engine):
    key = ApiKey(KEY)
    assert KEY not in repr(key) and key._digest == hashlib.sha256(KEY.encode()).digest()
    assert key.matches({"authorization": f"Bearer {KEY}"}) and key.matches({"x-api-key": KEY})
    assert key.matches({"x-api-key": "wrong", "authorization": f"bearer {KEY}"})
    assert not key.matches({"x-api-key": KEY[:-1]}) and not key.matches({"authorization": KEY}) and not key.matches({})
    server = Server(Runtime(smollm2_engine, MODEL_ID, max_active=1), api_key=KEY)
    try:
        assert KEY not in repr(vars(server)) and isinstance(server.api_key, ApiKey)
    finally:
        server.runtime.close()
    source = (ROOT / "agentfold" / "serve" / "auth.py").read_text()
    assert "hmac.compare_digest(_digest(candidate), self._digest)" in source  # constant time, over digests


async def test_everything_but_health_needs_the_key(smollm2_engine, tmp_path):
    with service_server(smollm2_engine, tmp_path / "home", api_key=KEY) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            for method, path in [("GET", "/"), ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/metrics"),
                                 ("GET", "/dashboard"), ("GET", "/dashboard/turns.json"),
                                 ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/responses"), ("POST", "/v1/messages"),
                                 ("POST", "/v1/messages/count_tokens"), ("POST", "/mcp"), ("GET", "/mcp")]:
                for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                    response = http.request(method, path, headers=headers, json={})
                    assert response.status_code == 401, (method, path, headers, response.text)
                    if path.startswith("/v1") or path in ("/", "/metrics"):
                        assert_api_error(response, 401, "API key")
            assert http.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
            assert http.get("/dashboard", headers={"x-api-key": KEY}).status_code == 200
        oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)  # sends Authorization: Bearer
        assert oa.chat.completions.create(model="m", messages=HI, max_tokens=1).usage.completion_tokens == 1
        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)  # sends x-api-key
        assert claude.messages.create(model="claude-x", max_tokens=1, messages=HI).usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0).messages.create(
                model="claude-x", max_tokens=1, messages=HI)
        import httpx2  # the transport the mcp SDK's HTTP client uses
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers={"x-api-key": KEY}) as keyed:
            async with Client(streamable_http_client(url + "/mcp", http_client=keyed)) as client:
                assert not (await client.call_tool("list_sessions", {})).is_error


# ---------------------------------------------------------------------------------------------
# Browsers: DNS rebinding, cross-site requests, CORS
# ---------------------------------------------------------------------------------------------

def test_rebinding_and_cross_site_requests_are_refused(smollm2_engine, tmp_path):
    mcp_init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    mcp_headers = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    with service_server(smollm2_engine, tmp_path / "home") as (url, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/mcp", json=mcp_init, headers=mcp_headers).status_code == 200  # a local client
            for path in ("/mcp", "/v1/chat/completions", "/v1/messages", "/health"):
                body = mcp_init if path == "/mcp" else {"model": "m", "messages": HI, "max_tokens": 1}
                evil_host = http.post(path, json=body, headers={**mcp_headers, "host": "evil.example"})
                assert evil_host.status_code == 421, (path, evil_host.text)
                evil_origin = http.post(path, json=body, headers={**mcp_headers, "origin": "http://evil.example"})
                assert evil_origin.status_code == 403, (path, evil_origin.text)
                assert "access-control-allow-origin" not in evil_origin.headers
            assert_api_error(http.post("/v1/chat/completions", json={}, headers={"host": "evil.example:80"}), 421,
                             "DNS-rebinding")
            assert_api_error(http.post("/v1/messages", json={}, headers={"origin": "null"}), 403, "--cors-origin")
            for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):  # loopback names are fine
                assert http.get("/health", headers={"host": host}).status_code == 200
            # CORS is off: no Access-Control-Allow-Origin anywhere, not even on a preflight from loopback
            preflight = http.options("/v1/chat/completions", headers={
                "origin": "http://localhost:3000", "access-control-request-method": "POST"})
            assert "access-control-allow-origin" not in preflight.headers and preflight.status_code >= 400
            same_host = http.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1},
                                  headers={"origin": "http://localhost:3000"})
            assert same_host.status_code == 200 and "access-control-allow-origin" not in same_host.headers


def test_cors_is_opt_in(smollm2_engine, tmp_path):
    app_origin = "https://app.example"
    with service_server(smollm2_engine, tmp_path / "home", cors_origins=[app_origin]) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as http:
            ok = http.options("/v1/chat/completions", headers={"origin": app_origin,
                                                               "access-control-request-method": "POST",
                                                               "access-control-request-headers": "content-type"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == app_origin
            other = http.options("/v1/chat/completions", headers={"origin": "https://other.example",
                                                                  "access-control-request-method": "POST"})
            assert other.headers.get("access-control-allow-origin") != "https://other.example"
            reply = http.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1},
                              headers={"origin": app_origin})
            assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == app_origin


# ---------------------------------------------------------------------------------------------
# Paths, pickle, limits
# ---------------------------------------------------------------------------------------------

def test_request_data_never_names_a_file(smollm2_engine, tmp_path):
    with service_server(smollm2_engine, tmp_path / "home") as (url, _):
        reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"model": "/etc/passwd", "messages": HI, "max_tokens": 1}).json()
        assert reply["model"] == "/etc/passwd" and reply["usage"]["completion_tokens"] == 1  # just a name
        listing = httpx.get(url + "/v1/models/..%2F..%2Fetc%2Fpasswd", timeout=60)
        assert "root:" not in listing.text
        assert_api_error(httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": HI, "max_tokens": 1, "session_id": "../../../tmp/x"}), 400, "session id")
    assert not any(".." in p.name or p.name == "x" for p in (tmp_path / "home").rglob("*"))


def test_no_pickle_anywhere():
    """Weights load from safetensors and GGUF only: no pickle, no torch.load without weights_only, no remote code.

    (transformers' own `from_pretrained`, used by the torch baselines, loads with weights_only=True.)
    """
    risky = re.compile(r"\bpickle\b|\bcPickle\b|joblib|allow_pickle\s*=\s*True|\bnp\.load\(|numpy\.load\(|"
                       r"marshal\.loads?\(|use_safetensors\s*=\s*False|weights_only\s*=\s*False|"
                       r"trust_remote_code\s*=\s*True")
    found = []
    for path in CODE:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if risky.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
            if "torch.load(" in line and "weights_only=True" not in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_full_queue_is_429_with_retry_after(smollm2_engine, tmp_path):
    with service_server(smollm2_engine, tmp_path / "home", max_active=1, max_queue=0) as (url, service):
        runtime = service.runtime
        holding = threading.Event()

        def hold() -> None:  # one long reply takes the only slot
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                    "model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
                    "max_tokens": 500, "stream": True}) as stream:
                for _ in stream.iter_lines():
                    if runtime.running():
                        holding.set()
                    if release.is_set():
                        return

        release = threading.Event()
        worker = threading.Thread(target=hold, daemon=True)
        worker.start()
        try:
            assert holding.wait(60)
            busy = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1})
            message = assert_api_error(busy, 429, "busy", "--max-queue")
            assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["code"] == "queue_full"
            assert message
            busy = httpx.post(url + "/v1/messages", json={"model": "m", "messages": HI, "max_tokens": 1})
            assert_api_error(busy, 429, "busy")
            assert busy.json()["error"]["type"] == "rate_limit_error" and "retry-after" in busy.headers
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                    model="m", messages=HI, max_tokens=1)
        finally:
            release.set()
            worker.join(60)
        assert wait_idle(runtime, 60)
        reply = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1})
        assert reply.status_code == 200, json.dumps(reply.json())
