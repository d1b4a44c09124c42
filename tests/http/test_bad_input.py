"""Bad input on every endpoint and every MCP tool: a 4xx (or tool error) that says what to fix, nothing stored.

One full serving stack (Service + build_app: the APIs, MCP at /mcp, sessions in a real SQLite
file) on loopback. A real turn is stored first; after all the bad requests the session index rows
and every snapshot file's sha256 are unchanged, and the server still answers normal requests on
every API. (tests/http/test_errors.py covers the basic cases; these are the rest.)
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from mcp import Client

from tests.helpers.reliability_helpers import assert_api_error, service_server, store_state

pytestmark = pytest.mark.anyio

MAX_BODY = 256 * 1024  # a small limit, so the oversized cases stay cheap
HI = [{"role": "user", "content": "Hi"}]
LONG = "word " * 9000  # more tokens than SmolLM2's 8192-token context
TRAVERSAL = "../../etc/passwd"
SQL = "x'; DROP TABLE snapshots;--"
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"


def chat(**fields):
    return {"model": "m", "messages": HI, "max_tokens": 2, **fields}


def completion(**fields):
    return {"model": "m", "prompt": "Once upon a time", "max_tokens": 2, **fields}


def response(**fields):
    return {"model": "m", "input": "Hi", "max_output_tokens": 2, **fields}


def message(**fields):
    return {"model": "claude-sonnet-4-6", "messages": HI, "max_tokens": 2, **fields}


def raw(text: str) -> bytes:
    return text.encode()


BAD_SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "wizard"}}}

# (path, body: dict | bytes, extra headers, status, words the message must hold)
HTTP_CASES = [
    # /v1/chat/completions
    (CHAT, b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}', {}, 400, ["UTF-8"]),
    (CHAT, raw('{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"\\ud800"}]}'), {}, 400,
     ["surrogate"]),
    (CHAT, b"[" * 50_000, {}, 400, ["not valid JSON"]),
    (CHAT, raw('{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":1e400}'), {}, 400,
     ["'max_tokens' must be an integer"]),
    (CHAT, chat(temperature="hot"), {}, 400, ["'temperature' must be a number"]),
    (CHAT, chat(temperature=5e-324), {}, 400, ["temperature must be 0 (greedy) or at least"]),
    (CHAT, raw('{"model":"m","messages":[{"role":"user","content":"Hi"}],"temperature":NaN}'), {}, 400,
     ["'temperature' must be a number"]),
    (CHAT, chat(messages=["Hi"]), {}, 400, ["messages[0]", "object"]),
    (CHAT, chat(messages=[{"content": "Hi"}]), {}, 400, ["messages[0].role"]),
    (CHAT, chat(tools="grep"), {}, 400, ["'tools' must be an array"]),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), {}, 400,
     ["JSON schema object"]),
    (CHAT, chat(tools=[BAD_SCHEMA_TOOL], tool_choice="required"), {}, 400, ["JSON schema", "wizard"]),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": "x"}}), {}, 400,
     ["schema"]),
    (CHAT, chat(tool_choice=5), {}, 400, ["'tool_choice' must be a string or an object"]),
    (CHAT, chat(session_id=TRAVERSAL), {}, 400, ["not a valid session id"]),
    (CHAT, chat(session_id=SQL), {}, 400, ["not a valid session id"]),
    (CHAT, chat(), {"x-session-id": TRAVERSAL}, 400, ["X-Session-Id", "not a valid session id"]),
    (CHAT, chat(session_id=123), {}, 400, ["'session_id' must be a string"]),
    (CHAT, chat(model=42), {}, 400, ["'model' must be a string"]),
    (CHAT, chat(stop=["x"] * 17), {}, 400, ["at most 16"]),
    (CHAT, chat(stream_options="yes"), {}, 400, ["'stream_options' must be an object"]),
    (CHAT, b'{"model": "m", "messages": []', {}, 400, ["not valid JSON"]),
    # /v1/completions
    (COMPLETIONS, completion(prompt=[999_999]), {}, 400, ["outside the vocabulary"]),
    (COMPLETIONS, completion(prompt=""), {}, 400, ["'prompt' is empty"]),
    (COMPLETIONS, completion(prompt=42), {}, 400, ["'prompt' must be a string"]),
    (COMPLETIONS, completion(prompt=LONG), {}, 400, ["maximum context length"]),
    (COMPLETIONS, completion(max_tokens=-3), {}, 400, ["'max_tokens' must be >= 1"]),
    (COMPLETIONS, completion(n_predict="all"), {}, 400, ["'n_predict' must be an integer"]),
    (COMPLETIONS, completion(session_id=SQL), {}, 400, ["not a valid session id"]),
    # /v1/responses
    (RESPONSES, response(instructions=5), {}, 400, ["'instructions' must be a string"]),
    (RESPONSES, response(text="json"), {}, 400, ["'text' must be an object"]),
    (RESPONSES, response(text={"format": {"type": "yaml"}}), {}, 400, ["text.format"]),
    (RESPONSES, response(tools=[{"type": "function", "parameters": {}}]), {}, 400, ["non-empty 'name'"]),
    (RESPONSES, response(input=[{"type": "function_call", "name": "f", "arguments": 5, "call_id": "c"}]), {}, 400,
     ["arguments"]),
    (RESPONSES, response(temperature=5), {}, 400, ["'temperature' must be <= 2"]),
    (RESPONSES, response(input=LONG), {}, 400, ["maximum context length"]),
    (RESPONSES, response(session_id=TRAVERSAL), {}, 400, ["not a valid session id"]),
    # /v1/messages
    (MESSAGES, message(max_tokens="many"), {}, 400, ["'max_tokens' must be an integer"]),
    (MESSAGES, message(system=5), {}, 400, ["system"]),
    (MESSAGES, message(tools=[{"name": "f", "input_schema": "x"}]), {}, 400, ["JSON schema object"]),
    (MESSAGES, message(tools={"name": "f"}), {}, 400, ["tools: must be an array"]),
    (MESSAGES, message(stop_sequences=7), {}, 400, ["stop_sequences"]),
    (MESSAGES, message(messages=[{"role": "user", "content": 7}]), {}, 400, ["messages.0.content"]),
    (MESSAGES, message(messages=[*HI, {"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]), {},
     400, ["name"]),
    (MESSAGES, message(messages=[{"role": "user", "content": LONG}]), {}, 400, ["prompt is too long"]),
    (MESSAGES, message(top_k="x"), {}, 400, ["'top_k' must be an integer"]),
    (MESSAGES, message(session_id=SQL), {}, 400, ["not a valid session id"]),
    (MESSAGES, b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"\xc3\x28"}]}', {}, 400,
     ["UTF-8"]),
    # /v1/messages/count_tokens
    (COUNT, {"model": "m"}, {}, 400, ["messages"]),
    (COUNT, {"model": "m", "messages": HI, "tools": [{"name": ""}]}, {}, 400, ["name"]),
    (COUNT, {"model": "m", "messages": HI, "system": {"text": "x"}}, {}, 400, ["system"]),
    (COUNT, b"null", {}, 400, ["JSON object"]),
]

PER_ENDPOINT = {path: sum(1 for case in HTTP_CASES if case[0] == path)
                for path in (CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT)}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def stack(smollm2_engine, tmp_path_factory):
    """The server, with one real stored turn, and the store's state right after it."""
    home = tmp_path_factory.mktemp("bad-input-home")
    with service_server(smollm2_engine, home, max_body_bytes=MAX_BODY) as (url, service):
        seeded = httpx.post(url + CHAT, json=chat(session_id="seeded"), timeout=120)
        assert seeded.status_code == 200, seeded.text
        service.telemetry.flush()
        before = store_state(home)
        assert before["sessions"] and before["files"]
        yield url, home, before


def post(url: str, path: str, body, headers: dict) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
    return httpx.post(url + path, headers={"content-type": "application/json", **headers}, timeout=120, **kwargs)


@pytest.mark.parametrize(("path", "body", "headers", "status", "words"), HTTP_CASES,
                         ids=[f"{c[0][4:].replace('/', '.')}-{i}" for i, c in enumerate(HTTP_CASES)])
def test_http_bad_input(stack, path, body, headers, status, words):
    url, _, _ = stack
    assert_api_error(post(url, path, body, headers), status, *words)


def test_oversized_bodies_get_413(stack):
    url, _, _ = stack
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])).encode()
    for path in (CHAT, MESSAGES):
        message = assert_api_error(post(url, path, big, {}), 413, str(MAX_BODY), "--max-body-bytes")
        assert "bytes" in message

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
        yield b'"}]}'

    response = httpx.post(url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert_api_error(response, 413, str(MAX_BODY))
    assert httpx.post(url + "/mcp", content=big, timeout=60, headers={
        "content-type": "application/json", "accept": "application/json, text/event-stream"}).status_code == 413


def test_models_routes(stack):
    url, _, _ = stack
    assert_api_error(httpx.post(url + "/v1/models", json={}), 405, "POST")
    assert_api_error(httpx.delete(url + "/v1/models/m"), 405, "DELETE")
    assert_api_error(httpx.get(url + "/v1/sessions/../../etc/passwd"), 404, "No route")


MCP_CASES = [
    ("generate", {}, ["exactly one"]),
    ("generate", {"prompt": "a", "messages": HI}, ["exactly one"]),
    ("generate", {"prompt": ""}, ["empty"]),
    ("generate", {"messages": []}, ["empty"]),
    ("generate", {"prompt": "a", "max_tokens": 0}, ["max_tokens"]),
    ("generate", {"prompt": "a", "max_tokens": "ten"}, ["max_tokens"]),
    ("generate", {"prompt": "a", "temperature": -1}, ["temperature"]),
    ("generate", {"prompt": "a", "temperature": 9}, ["temperature"]),
    ("generate", {"prompt": "a", "session_id": TRAVERSAL}, ["not a valid session id"]),
    ("generate", {"prompt": "a", "session_id": SQL}, ["not a valid session id"]),
    ("generate", {"prompt": "a", "max_tokens": 100_000}, ["context"]),
    ("generate", {"messages": [{"role": "wizard", "content": "x"}]}, ["role"]),
    ("check_exactness", {"prompt": "a", "max_tokens": 0}, ["max_tokens"]),
    ("check_exactness", {}, ["exactly one"]),
    ("audit_turn", {"turn_id": "turn-nope"}, ["no turn"]),
    ("get_turn", {"turn_id": SQL}, ["no turn"]),
    ("list_turns", {"limit": 0}, ["limit"]),
    ("list_turns", {"session_id": TRAVERSAL}, ["not a valid session id"]),
    ("latency_summary", {"window_seconds": -1}, ["window_seconds"]),
    ("get_session", {"session_id": SQL}, ["not a valid session id"]),
    ("get_session", {"session_id": "nobody"}, ["no session"]),
    ("fork_session", {"session_id": TRAVERSAL, "turn": 0}, ["not a valid session id"]),
    ("fork_session", {"session_id": "seeded", "turn": -1}, ["turn"]),
    ("fork_session", {"session_id": "seeded", "turn": 7}, ["no turn 7"]),
    ("pin_session", {"session_id": SQL}, ["not a valid session id"]),
    ("delete_session", {"session_id": TRAVERSAL}, ["not a valid session id"]),
    ("delete_session", {"session_id": "nobody"}, ["no session"]),
]


async def test_mcp_tools_bad_input(stack):
    url, _, _ = stack
    async with Client(url + "/mcp") as client:
        for name, args, words in MCP_CASES:
            result = await client.call_tool(name, args)
            assert result.is_error, (name, args, result.structured_content)
            text = " ".join(getattr(block, "text", "") for block in result.content)
            assert "Traceback" not in text
            for word in words:
                assert word.lower() in text.lower(), (name, args, text)


def test_nothing_stored_and_still_serving(stack):
    """Runs last in this module: the bad requests changed no row and no file, and every API still answers."""
    url, home, before = stack
    assert store_state(home) == before
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert oa.chat.completions.create(model="m", messages=HI, max_tokens=2).usage.completion_tokens == 2
    assert oa.completions.create(model="m", prompt="Once upon a time", max_tokens=2).usage.completion_tokens == 2
    assert oa.responses.create(model="m", input="Hi", max_output_tokens=2).status in ("completed", "incomplete")
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    assert claude.messages.create(model="claude-sonnet-4-6", max_tokens=2, messages=HI).usage.output_tokens == 2
    assert claude.messages.count_tokens(model="claude-sonnet-4-6", messages=HI).input_tokens > 0
    assert {m.id for m in oa.models.list()} >= {"SmolLM2-135M-Instruct"}


def test_case_counts():
    """At least 40 bad-input cases in all, on every endpoint and the MCP tools."""
    assert all(count >= 4 for count in PER_ENDPOINT.values()), PER_ENDPOINT
    assert sum(PER_ENDPOINT.values()) + len(MCP_CASES) + 3 + 3 >= 40
