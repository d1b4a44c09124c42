"""Calls the model writes as plain JSON reach clients as tool calls, and a prompt over the context
gets the error each client acts on; through the official `openai` and `anthropic` clients.

SmolLM2-135M, asked for a JSON call, writes it the way small models fall back to (a sentence,
then a fenced, pretty-printed JSON object), the same shape Qwen2.5-Coder gave Claude Code and
Codex as a final answer before. Every API, streamed or not, returns it as a tool call.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from tests.helpers.api_helpers import api_server  # noqa: F401  (fixture)

ASK = 'Reply with the JSON object {"name": "get_weather", "arguments": {"city": "Paris"}} and nothing else.'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Get the current weather for a city."
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                                "parameters": SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
CALL = ("get_weather", {"city": "Paris"})
OVERFLOW = "The quick brown fox jumps over the lazy dog. " * 1000  # ~10K tokens: over SmolLM2's 8K context


@pytest.fixture(scope="module")
def oai(api_server) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(api_server) -> anthropic.Anthropic:  # noqa: F811
    return anthropic.Anthropic(base_url=api_server.url, api_key="sk-ant-unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_reply(oai):
    return oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], tools=[OPENAI_TOOL],
                                       max_tokens=64)


def test_chat_completions_returns_the_json_as_a_call(chat_reply):
    choice = chat_reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [CALL]
    assert choice.message.content and "```" not in choice.message.content  # the sentence before the call


def test_chat_completions_streamed(oai, chat_reply):
    chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}],
                                              tools=[OPENAI_TOOL], max_tokens=64, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [e for c in chunks if c.choices for e in (c.choices[0].delta.tool_calls or [])]
    assert text == chat_reply.choices[0].message.content
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(e.function.arguments or "" for e in calls)) == CALL[1]
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.model_extra["agentfold"]["token_sha"] == chat_reply.model_extra["agentfold"]["token_sha"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_return_a_tool_use_block(claude, stream):
    request = {"model": "claude-sonnet-4-6", "max_tokens": 64, "tools": [ANTHROPIC_TOOL],
               "messages": [{"role": "user", "content": ASK}]}
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"] and message.content[0].text
    assert (message.content[1].name, message.content[1].input) == CALL and message.content[1].id


@pytest.mark.parametrize("stream", [False, True])
def test_responses_return_a_function_call_item(oai, stream):
    request = {"model": "gpt-5-codex", "input": ASK, "tools": [RESPONSES_TOOL], "max_output_tokens": 64}
    if stream:
        events = list(oai.responses.create(**request, stream=True))
        assert events[-1].type == "response.completed"
        output = events[-1].response.output
    else:
        output = oai.responses.create(**request).output
    assert [item.type for item in output] == ["message", "function_call"]
    assert (output[1].name, json.loads(output[1].arguments)) == CALL and output[1].call_id


# --- a prompt that does not fit ---------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_prompt_too_long_is_the_error_claude_code_compacts_on(claude, api_server, stream):  # noqa: F811
    request = {"model": "claude-sonnet-4-6", "max_tokens": 64, "messages": [{"role": "user", "content": OVERFLOW}]}
    with pytest.raises(anthropic.BadRequestError) as raised:
        if stream:
            with claude.messages.stream(**request) as events:
                events.get_final_message()
        else:
            claude.messages.create(**request)
    error = raised.value
    assert error.status_code == 400 and error.body["type"] == "error"
    assert error.body["error"]["type"] == "invalid_request_error"
    message = error.body["error"]["message"]
    # Claude Code 2.1.332's own pattern (its bundled JS): /^prompt is too long: \d+ tokens > \d+ maximum$/
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
    assert match, message
    tokens, maximum = int(match[1]), int(match[2])
    assert maximum == api_server.runtime.context_length - 1 and tokens > maximum
    counted = claude.messages.count_tokens(model="claude-sonnet-4-6", messages=request["messages"])
    assert counted.input_tokens == tokens  # count_tokens still answers, with the same count


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_context_length_exceeded(oai, stream):
    with pytest.raises(openai.BadRequestError) as raised:
        reply = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": OVERFLOW}],
                                            max_tokens=8, stream=stream)
        list(reply) if stream else None
    assert raised.value.status_code == 400 and raised.value.code == "context_length_exceeded"
    assert raised.value.body["type"] == "invalid_request_error" and raised.value.param == "messages"


def test_responses_context_length_exceeded(oai):
    """Not streamed: the 400 with the code. Streamed (as Codex always asks): `response.failed` with the
    code, which Codex 0.171 reads as a full context window (a 400 there is a fatal invalid request)."""
    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model="gpt-5-codex", input=OVERFLOW, max_output_tokens=8)
    assert raised.value.status_code == 400 and raised.value.code == "context_length_exceeded"
    events = list(oai.responses.create(model="gpt-5-codex", input=OVERFLOW, max_output_tokens=8, stream=True))
    assert [e.type for e in events] == ["response.created", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "context_length_exceeded"
    assert "maximum context length" in failed.error.message
