"""Bad requests get a 4xx in each API's own error shape, with a message saying what to fix."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from agentfold.http.app import create_app
from tests.helpers.api_helpers import ServerThread, api_server  # noqa: F401  (fixture)

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


def chat(**fields):
    return {"model": "m", "messages": MESSAGES, "max_tokens": 1, **fields}


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    for word in words:
        assert word in body["error"]["message"], body["error"]["message"]


OPENAI_CASES = [
    (CHAT, b"{not json", ["not valid JSON"]),
    (CHAT, b"[1, 2]", ["JSON object"]),
    (CHAT, b"", ["empty"]),
    (CHAT, chat(messages=[]), ["'messages' is empty"]),
    (CHAT, chat(messages="hello"), ["'messages' must be an array"]),
    (CHAT, {"model": "m"}, ["'messages'"]),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), ["role", "wizard"]),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), ["content"]),
    (CHAT, chat(max_tokens=-5), ["'max_tokens' must be >= 1"]),
    (CHAT, chat(max_tokens=0), ["'max_tokens' must be >= 1"]),
    (CHAT, chat(max_tokens="ten"), ["'max_tokens' must be an integer"]),
    (CHAT, chat(max_completion_tokens=2.5), ["'max_completion_tokens' must be an integer"]),
    (CHAT, chat(temperature=3), ["'temperature' must be <= 2"]),
    (CHAT, chat(temperature=-0.1), ["'temperature' must be >= 0"]),
    (CHAT, chat(top_p=0), ["'top_p' must be > 0"]),
    (CHAT, chat(min_p=2), ["'min_p' must be <= 1"]),
    (CHAT, chat(stream="yes"), ["'stream' must be true or false"]),
    (CHAT, chat(stop=[1, 2]), ["'stop'"]),
    (CHAT, chat(seed="abc"), ["'seed' must be an integer"]),
    (CHAT, chat(n=2), ["'n' must be 1"]),
    (CHAT, chat(draft="no"), ["'draft' must be true or false"]),
    (CHAT, chat(tools=[{"type": "function", "function": {"description": "no name"}}]), ["name"]),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                       "function": {"name": "g"}}),
     ["'g'", "not among"]),
    (CHAT, chat(tool_choice="required"), ["no tools"]),
    (CHAT, chat(response_format={"type": "yaml"}), ["response_format"]),
    ("/v1/completions", {"model": "m"}, ["'prompt' is required"]),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, ["one prompt"]),
    ("/v1/responses", {"model": "m", "input": 42}, ["'input' must be a string or an array"]),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": -1}, ["'max_output_tokens' must be >= 1"]),
    ("/v1/responses", {"model": "m", "input": [{"type": "message", "role": "robot", "content": "x"}]}, ["role"]),
]


@pytest.mark.parametrize(("path", "body", "words"), OPENAI_CASES)
def test_openai_shaped_400s(api_server, path, body, words):  # noqa: F811
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(api_server.url + path, timeout=60, headers={"content-type": "application/json"}, **kwargs)
    assert_openai_error(response, 400, *words)


def test_context_overflow(api_server):  # noqa: F811
    """A prompt over the context is a 400 in each API's shape (a max_tokens over it is clamped instead)."""
    long_prompt = [{"role": "user", "content": "word " * 9000}]
    error = assert_openai_error(httpx.post(api_server.url + CHAT, json=chat(messages=long_prompt), timeout=60), 400,
                                "8192", "prompt")
    assert error["code"] == "context_length_exceeded"
    client = openai.OpenAI(base_url=api_server.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=long_prompt, max_tokens=10)
    assert caught.value.code == "context_length_exceeded"
    anthropic_error = httpx.post(api_server.url + "/v1/messages", timeout=60,
                                 json={"model": "m", "max_tokens": 10, "messages": long_prompt})
    # Anthropic's wording, which Claude Code parses to compact: the longest prompt that fits is 8191 tokens
    assert_anthropic_error(anthropic_error, 400, "invalid_request_error", "prompt is too long: ", " > 8191 maximum")


def test_routes_and_methods(api_server):  # noqa: F811
    assert_openai_error(httpx.get(api_server.url + "/v1/nothing-here"), 404, "/v1/nothing-here")
    assert_openai_error(httpx.get(api_server.url + CHAT), 405, "GET")
    assert_anthropic_error(httpx.get(api_server.url + "/v1/messages"), 405, "invalid_request_error")


ANTHROPIC_CASES = [
    (b"{oops", "not valid JSON"),
    ({"model": "m", "max_tokens": 5}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "at least one message"),
    ({"model": "m", "max_tokens": -1, "messages": MESSAGES}, "'max_tokens' must be >= 1"),
    ({"model": "m", "max_tokens": 5, "messages": MESSAGES, "temperature": 1.5}, "'temperature' must be <= 1"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "text"),
    ({"model": "m", "max_tokens": 5, "messages": MESSAGES, "tool_choice": {"type": "tool", "name": "nope"}},
     "nope"),
]


@pytest.mark.parametrize(("body", "words"), ANTHROPIC_CASES)
def test_anthropic_shaped_400s(api_server, body, words):  # noqa: F811
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and ("max_tokens" in words or "temperature" in words or "nope" in words):
            continue  # count_tokens does not read sampling fields
        response = httpx.post(api_server.url + path, timeout=60, headers={"content-type": "application/json"},
                              **kwargs)
        assert_anthropic_error(response, 400, "invalid_request_error", words)


def test_anthropic_client_sees_typed_errors(api_server):  # noqa: F811
    client = anthropic.Anthropic(base_url=api_server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="claude-sonnet-4-6", max_tokens=5, messages=[])
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(api_server):  # noqa: F811
    body = chat(logit_bias={"1": 5}, reasoning_effort="low", stream_options={"include_usage": True},
                frobnicate={"a": 1}, user="me", metadata={"k": "v"}, parallel_tool_calls=False, logprobs=False)
    response = httpx.post(api_server.url + CHAT, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_api_key_when_configured(api_server):  # noqa: F811
    server = ServerThread(create_app(api_server.runtime, api_key="secret")).start()
    try:
        assert_openai_error(httpx.get(server.url + "/v1/models"), 401, "API key")
        response = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": MESSAGES})
        assert_anthropic_error(response, 401, "authentication_error")
        assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "secret"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer secret"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    finally:
        server.stop()
