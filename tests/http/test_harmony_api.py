"""A harmony (gpt-oss) reply on every API, streamed and not, through the official `openai` and
`anthropic` clients against a real uvicorn server.

No model here writes harmony by itself (the random-weight gpt-oss GGUF writes noise), so the server
runs the real SmolLM2-135M engine with gpt-oss's real chat template (llama.cpp's copy, in
tests/fixtures/harmony/) on its tokenizer: every prompt is rendered by the gpt-oss template, which
makes the server read replies as harmony. The reply text itself is forced: `HarmonyRuntime` puts a
grammar on each turn that admits exactly the scripted harmony text (`<|channel|>analysis<|message|>
...<|end|><|start|>assistant...`, as the engine will detokenize gpt-oss's special tokens), so the
engine decodes that text token by token under the grammar (the decode loop, drafting, the
detokenizer and the end-of-turn token are the real ones; the grammar then allows only the end of
the turn, as gpt-oss ends a call with `<|call|>`, which is not in the text). What is exercised
from there is everything after the model: the harmony parser choice, streaming, each API's
reasoning / content / tool-call shapes, `reasoning_tokens`, and earlier reasoning sent back in
each API's own field reaching the template (seen as the prompt growing by the analysis message).
One test leaves the reply free and forces a call with `tool_choice`: SmolLM2 then writes the call
in harmony form under the server's own harmony grammar.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from agentfold.http.app import create_app
from agentfold.serve.scheduler import Runtime
from tests.helpers.api_helpers import ServerThread, wait_idle

TEMPLATE = (Path(__file__).resolve().parents[1] / "fixtures" / "harmony" / "openai-gpt-oss-120b.jinja").read_text()
MODEL = "gpt-oss-20b"

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                "parameters": SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.", "parameters": SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather of a city.", "input_schema": SCHEMA}

THINK = "The user asks for the weather in Paris. I should call get_weather."
PREAMBLE = "Let me look that up."
CALL_REPLY = (f"<|channel|>analysis<|message|>{THINK}<|end|>"
              f"<|start|>assistant<|channel|>commentary<|message|>{PREAMBLE}<|end|>"
              '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
ANSWER_THINK = "The tool says sunny, 21 C. Answer briefly."
ANSWER = "It is sunny in Paris, 21 °C."
ANSWER_REPLY = (f"<|channel|>analysis<|message|>{ANSWER_THINK}<|end|>"
                f"<|start|>assistant<|channel|>final<|message|>{ANSWER}")
ASK = "What is the weather in Paris?"


class HarmonyRuntime(Runtime):
    """A runtime whose chat template is gpt-oss's, and whose next replies are `script`'s text
    (a grammar admitting exactly that text); `script = None` leaves the reply to the model."""

    script: str | None = None

    def _start(self, request):
        if self.script is not None:
            request.config.grammar = f"start: {json.dumps(self.script, ensure_ascii=False)}\n"
        return super()._start(request)


@pytest.fixture(scope="module")
def harmony_server(smollm2_engine) -> Iterator[HarmonyRuntime]:
    runtime = HarmonyRuntime(smollm2_engine, MODEL, max_active=2)
    runtime.tokenizer = copy.copy(smollm2_engine.tokenizer)  # the same vocabulary, gpt-oss's template
    runtime.tokenizer.chat_template = TEMPLATE
    server = ServerThread(create_app(runtime)).start()
    runtime.url = server.url
    try:
        yield runtime
    finally:
        wait_idle(runtime)
        server.stop()
        runtime.close()


@pytest.fixture(scope="module")
def oai(harmony_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(harmony_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=harmony_server.url, api_key="sk-ant-unused", max_retries=0, timeout=300)


def scripted(runtime: HarmonyRuntime, text: str | None) -> None:
    runtime.script = text


# --- Chat Completions -------------------------------------------------------------------------------

def test_chat_completions_reasoning_content_and_call(oai, harmony_server):
    scripted(harmony_server, CALL_REPLY)
    request = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": [OPENAI_TOOL],
               "max_tokens": 256}
    reply = oai.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == THINK
    assert choice.message.content == PREAMBLE
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < reply.usage.completion_tokens

    chunks = list(oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")]
    assert len(reasoning) > 1 and "".join(reasoning) == THINK  # streamed as it came, never a control token
    assert "".join(d.content or "" for d in deltas) == PREAMBLE
    calls = [e for d in deltas for e in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(e.function.arguments or "" for e in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_chat_completions_answer_and_reasoning_sent_back(oai, harmony_server):
    """The final channel is the answer; the analysis is never in it. The assistant's earlier
    `reasoning_content`, sent back with its call, is rendered (gpt-oss renders the analysis before
    a call when no final answer follows it): the prompt is longer by it."""
    scripted(harmony_server, ANSWER_REPLY)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    without = oai.chat.completions.create(model=MODEL, messages=history, tools=[OPENAI_TOOL], max_tokens=256)
    history[1] = {**history[1], "reasoning_content": THINK}
    reply = oai.chat.completions.create(model=MODEL, messages=history, tools=[OPENAI_TOOL], max_tokens=256)
    for answer in (without, reply):
        assert answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content == ANSWER
        assert answer.choices[0].message.model_extra["reasoning_content"] == ANSWER_THINK
    assert reply.usage.prompt_tokens > without.usage.prompt_tokens


# --- Responses --------------------------------------------------------------------------------------

def test_responses_reasoning_item_first(oai, harmony_server):
    scripted(harmony_server, CALL_REPLY)
    request = {"model": MODEL, "input": ASK, "tools": [RESPONSES_TOOL], "max_output_tokens": 256}
    response = oai.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.summary == [] and [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THINK)]
    assert message.content[0].text == PREAMBLE
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens

    events = list(oai.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    streamed = events[-1].response.output
    assert [item.type for item in streamed] == ["reasoning", "message", "function_call"]
    assert streamed[0].content[0].text == THINK and streamed[1].content[0].text == PREAMBLE
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == THINK
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == THINK and done.item_id == streamed[0].id
    first = kinds.index("response.output_item.added")
    assert events[first].item.type == "reasoning"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_responses_reasoning_items_sent_back(oai, harmony_server):
    """A `reasoning` input item before the call it led to is that call's `thinking`."""
    scripted(harmony_server, ANSWER_REPLY)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}
    ask = {"type": "message", "role": "user", "content": ASK}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THINK}]}
    base = {"model": MODEL, "tools": [RESPONSES_TOOL], "max_output_tokens": 256, "store": False}
    without = oai.responses.create(input=[ask, call, output], **base)
    reply = oai.responses.create(input=[ask, thought, call, output], **base)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[1].content[0].text == ANSWER
    assert reply.usage.input_tokens > without.usage.input_tokens


# --- Anthropic Messages -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_block_first(claude, harmony_server, stream):
    scripted(harmony_server, CALL_REPLY)
    request = {"model": MODEL, "max_tokens": 256, "tools": [ANTHROPIC_TOOL], "messages": [{"role": "user", "content": ASK}]}
    if stream:
        with claude.messages.stream(**request) as events:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
            message = events.get_final_message()
        assert ("content_block_delta", "thinking_delta") in kinds
        assert kinds.index(("content_block_delta", "thinking_delta")) < kinds.index(("content_block_delta", "text_delta"))
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert (message.content[0].thinking, message.content[0].signature) == (THINK, "")
    assert message.content[1].text == PREAMBLE
    assert (message.content[2].name, message.content[2].input) == ("get_weather", {"city": "Paris"})


def test_anthropic_thinking_blocks_sent_back(claude, harmony_server):
    scripted(harmony_server, ANSWER_REPLY)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]}
    plain = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [use]}, result]
    thought = [plain[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": THINK, "signature": ""},
                                                           use]}, result]
    counted = [claude.messages.count_tokens(model=MODEL, messages=m, tools=[ANTHROPIC_TOOL]).input_tokens
               for m in (plain, thought)]
    assert counted[1] > counted[0]
    message = claude.messages.create(model=MODEL, max_tokens=256, tools=[ANTHROPIC_TOOL], messages=thought)
    assert message.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", ANSWER_THINK), ("text", ANSWER)]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted[1]


# --- the reply cut short, and a forced call in harmony form ------------------------------------------

def test_a_reply_cut_inside_its_analysis_has_reasoning_and_no_answer(oai, harmony_server):
    scripted(harmony_server, ANSWER_REPLY)
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=18)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content == "" and choice.message.model_extra["reasoning_content"]
    assert ANSWER_THINK.startswith(choice.message.model_extra["reasoning_content"])


def test_a_forced_call_is_written_in_harmony_form(oai, harmony_server):
    """tool_choice names the tool: the server's harmony grammar holds the (free) model to
    `<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}`."""
    scripted(harmony_server, None)
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[OPENAI_TOOL],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
