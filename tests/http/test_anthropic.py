"""Anthropic Messages as Claude Code uses it, through the official `anthropic` client."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.helpers.api_helpers import api_server  # noqa: F401  (fixture)

MODEL = "claude-sonnet-4-6"  # any name reaches the one model served
SYSTEM = [{"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}}]
HELLO = [{"role": "user", "content": [{"type": "text", "text": "Say hello to Ada."}]}]
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}


@pytest.fixture(scope="module")
def client(api_server) -> anthropic.Anthropic:  # noqa: F811
    # a key is sent (Claude Code always sends one); with none configured the server ignores it
    return anthropic.Anthropic(base_url=api_server.url, api_key="sk-ant-unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hello(client):
    return client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=HELLO)


def test_message(hello):
    assert hello.type == "message" and hello.role == "assistant" and hello.model == MODEL
    assert hello.content[0].type == "text" and hello.content[0].text
    assert hello.stop_reason == "max_tokens" and hello.stop_sequence is None
    assert hello.usage.output_tokens == 8 and hello.usage.input_tokens > 5
    assert hello.usage.cache_read_input_tokens == 0
    assert "timings" in hello.model_extra and "agentfold" in hello.model_extra


def test_stream_events_beta(client, hello):
    """`client.beta.messages` posts to /v1/messages?beta=true, as Claude Code does."""
    with client.beta.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=HELLO,
                                     betas=["interleaved-thinking-2025-05-14"]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == hello.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_raw_stream_shape(api_server):  # noqa: F811
    body = {"model": MODEL, "max_tokens": 4, "messages": HELLO, "stream": True}
    with httpx.stream("POST", api_server.url + "/v1/messages?beta=true", json=body, timeout=120,
                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"}) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_stop_sequence(client, hello):
    text = hello.content[0].text
    cut = text.split()[1] if len(text.split()) > 1 else text[-2:]
    reply = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=HELLO, stop_sequences=[cut])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == cut
    assert reply.content[0].text == text[: text.index(cut)]


def test_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=48, messages=messages, tools=[WEATHER, SERVER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_") and isinstance(use.input["city"], str)
    deltas = [e for e in events if e.type == "content_block_delta" or e.type == "input_json"]
    assert any(getattr(e, "delta", None) is not None and e.delta.type == "input_json_delta" for e in deltas)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "Sunny, 22 C"}]}]}]
    final = client.messages.create(model=MODEL, max_tokens=10, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text


def test_count_tokens(client, hello):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO)
    assert counted.input_tokens == hello.usage.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens
