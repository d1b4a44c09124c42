"""Anthropic Messages as Claude Code uses it, through the official `anthropic` client."""

from __future__ import annotations

import json
import logging

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


# --- what Claude Code 2.1.332 sends (tests/fixtures/claude_code/, replayed in test_claude_code_replay.py) ---

ENVIRONMENT = "# Environment\nPrimary working directory: /home/user/project"
SESSION = "b4b29e71-0aca-4f80-8c82-568c5a803147"  # a UUID, as Claude Code's session ids are


def post(api_server, body, headers=None, path="/v1/messages"):  # noqa: F811
    return httpx.post(api_server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=120,
                      headers={"anthropic-version": "2023-06-01", **(headers or {})})


def test_system_message_after_the_user_message(api_server):  # noqa: F811
    messages = [HELLO[0], {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT}]}]
    reply = post(api_server, {"system": SYSTEM, "messages": messages})
    assert reply.status_code == 200, reply.text
    counted = post(api_server, {"system": SYSTEM, "messages": messages}, path="/v1/messages/count_tokens")
    alone = post(api_server, {"system": SYSTEM, "messages": HELLO}, path="/v1/messages/count_tokens")
    assert counted.json()["input_tokens"] > alone.json()["input_tokens"] + 10  # rendered, not dropped


def _rendered_turns(tokenizer, tools):
    """Two turns of a Claude Code-shaped conversation, each rendered as the server renders it."""
    from agentfold.chat.template import render_chat
    from agentfold.http.anthropic_api import parse_messages, parse_tools

    turn1 = [HELLO[0], {"role": "system", "content": ENVIRONMENT}]
    turn2 = [*turn1, {"role": "assistant", "content": [{"type": "text", "text": "Hello, Ada!"}]},
             {"role": "user", "content": "Now in French."}, {"role": "system", "content": "Reminder: be brief."}]
    specs = parse_tools(tools)
    return [render_chat(tokenizer, parse_messages(turn, SYSTEM), specs) for turn in (turn1, turn2)]


@pytest.mark.parametrize("tools", [[], [WEATHER]])
def test_system_messages_render_in_place_and_prefix_stable(api_server, tools):  # noqa: F811
    first, second = _rendered_turns(api_server.runtime.tokenizer, tools)
    assert second.startswith(first)  # the next turn extends this prompt: the session cache is reused
    assert first.index("Say hello to Ada.") < first.index(ENVIRONMENT)  # where it was sent
    assert second.index("Now in French.") < second.index("Reminder: be brief.")


# Gemma 3's chat template, as far as roles go: the first system message folded into the first user
# turn, then user and model strictly alternating (anything else raises)
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_system_messages_on_a_strictly_alternating_template():
    """A template that refuses a system turn after the first gets the text as user text, still prefix-stable."""
    from tests.helpers.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = ALTERNATING_TEMPLATE
    first, second = _rendered_turns(tokenizer, [])
    assert second.startswith(first) and ENVIRONMENT in first and "Reminder: be brief." in second
    assert "<start_of_turn>system" not in second and second.count("<start_of_turn>user") == 2


def test_max_tokens_beyond_the_context_is_clamped(api_server, caplog):  # noqa: F811
    """As llama-server: Claude Code's max_tokens (32000 / 128000) exceeds most local contexts."""
    from agentfold.chat.plan import ChatPlan
    from agentfold.serve.chat_turn import prepare_turn

    runtime = api_server.runtime
    plan = ChatPlan(messages=[{"role": "user", "content": "Hi"}], max_tokens=32000)
    with caplog.at_level(logging.INFO, logger="agentfold.serve.chat_turn"):
        prepared = prepare_turn(runtime, plan, "messages")
    room = runtime.context_length - prepared.prompt_tokens
    assert prepared.request.config.max_tokens == room
    assert prepared.request.max_tokens_clamped == {
        "requested": 32000, "granted": room, "prompt_tokens": prepared.prompt_tokens,
        "context_length": runtime.context_length}
    assert f"'max_tokens' 32000 clamped to {room}" in caplog.text
    plan.max_tokens = room  # a budget that fits is kept and not reported
    fits = prepare_turn(runtime, plan, "messages")
    assert fits.request.config.max_tokens == room and fits.request.max_tokens_clamped is None


CLAUDE_CODE_FIELDS = {
    "max_tokens": 32000, "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": json.dumps({"device_id": "0" * 64, "account_uuid": "", "session_id": SESSION})},
}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def test_claude_code_beta_fields(api_server):  # noqa: F811
    """thinking / context_management / effort are accepted (ignored), output_config.format is
    honoured (the JSON answer ends the reply well inside the clamped 32000 budget), and the
    max_tokens clamp is reported."""
    body = {**CLAUDE_CODE_FIELDS, "messages": HELLO,
            "output_config": {"effort": "medium", "format": {"type": "json_schema", "schema": ANSWER}}}
    reply = post(api_server, body, {"anthropic-beta": "context-management-2025-06-27,effort-2025-11-24"},
                 path="/v1/messages?beta=true")
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert isinstance(json.loads(answer["content"][0]["text"])["ok"], bool)
    assert answer["stop_reason"] == "end_turn"
    assert answer["agentfold"]["max_tokens_clamped"]["requested"] == 32000


SESSION_CASES = [  # (body fields, headers, the session the turn runs in)
    ({}, {"X-Claude-Code-Session-Id": SESSION}, SESSION),
    ({"metadata": CLAUDE_CODE_FIELDS["metadata"]}, {}, SESSION),
    ({"metadata": {"user_id": "user-123"}}, {}, None),  # an opaque user id is not a session
    ({"session_id": "mine"}, {"X-Claude-Code-Session-Id": SESSION}, "mine"),  # the explicit key wins
    ({"metadata": CLAUDE_CODE_FIELDS["metadata"]}, {"X-Session-Id": "header"}, "header"),
]


def test_claude_code_session_id(api_server):  # noqa: F811
    for body, headers, session in SESSION_CASES:
        reply = post(api_server, {"messages": HELLO, **body}, headers)
        assert reply.status_code == 200, reply.text
        assert reply.json()["agentfold"]["session_id"] == session, (body, headers)


@pytest.mark.parametrize(("body", "headers", "where"), [
    ({}, {"X-Claude-Code-Session-Id": "../etc/passwd"}, "X-Claude-Code-Session-Id"),
    ({"metadata": {"user_id": json.dumps({"session_id": "x'; DROP TABLE s;--"})}}, {}, "metadata.user_id"),
])
def test_bad_client_session_id(api_server, body, headers, where):  # noqa: F811
    reply = post(api_server, {"messages": HELLO, **body}, headers)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert where in reply.json()["error"]["message"]


PIXEL = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


@pytest.mark.parametrize(("content", "where"), [
    ([{"type": "text", "text": "What is this?"}, {"type": "image", "source": PIXEL}], "messages.0.content.1"),
    ([{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}],
     "messages.0.content.0"),
    ([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": PIXEL}]}],
     "messages.0.content.0.content.0"),
])
def test_image_and_document_blocks_are_refused(api_server, content, where):  # noqa: F811
    reply = post(api_server, {"messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "text-only" in reply.json()["error"]["message"] and where in reply.json()["error"]["message"]
