"""OpenAI Responses as Codex CLI uses it, through the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentfold.http.response_store import ResponseStore
from tests.helpers.api_helpers import api_server  # noqa: F401  (fixture)

READ = {"type": "function", "name": "read_file", "description": "Read a file and return its contents.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Path of the file"}},
                       "required": ["path"]}}
# what Codex mixes in: a freeform custom tool and hosted tools this server does not run
CODEX_EXTRAS = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
                 "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                {"type": "web_search"}, {"type": "local_shell"}]


@pytest.fixture(scope="module")
def client(api_server) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0, timeout=120)


def test_string_input(client):
    reply = client.responses.create(model="gpt-5-codex", input="Say hello.", instructions="Be brief.",
                                    max_output_tokens=6)
    assert reply.object == "response" and reply.output_text
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    usage = reply.usage
    assert usage.output_tokens == 6 and usage.input_tokens > 5
    assert usage.input_tokens_details.cached_tokens == 0 and usage.total_tokens == usage.input_tokens + 6
    assert "timings" in reply.model_extra and len(reply.model_extra["agentfold"]["token_sha"]) == 64


def test_stream_event_sequence(client):
    events = list(client.responses.create(model="gpt-5-codex", input="Say hello.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = events[-1].response
    assert completed.output_text == text and completed.usage.output_tokens == 6
    assert completed.usage.input_tokens_details.cached_tokens == 0
    same = client.responses.create(model="gpt-5-codex", input="Say hello.", max_output_tokens=6)
    assert same.output_text == text


def test_function_call_round_trip(client):
    tools = [READ, *CODEX_EXTRAS]  # unknown tool types are dropped, not refused
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read the file README.md."}]}]
    events = list(client.responses.create(model="gpt-5-codex", input=items, tools=tools, stream=True,
                                          tool_choice={"type": "function", "name": "read_file"},
                                          parallel_tool_calls=False, max_output_tokens=48))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.arguments == "" and added.item.name == "read_file"
    call = next(e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
    assert call.call_id and json.loads(call.arguments)["path"]
    assert events[-1].response.output[-1].call_id == call.call_id
    items += [{"type": "function_call", "call_id": call.call_id, "name": "read_file", "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "# Demo\nA demo project."},
              {"type": "reasoning", "summary": []}]
    final = client.responses.create(model="gpt-5-codex", input=items, tools=tools, tool_choice="none",
                                    max_output_tokens=10)
    assert final.output_text and all(item.type == "message" for item in final.output)


def test_codex_probe_and_stateless_fields(api_server):  # noqa: F811
    body = {"model": "gpt-5-codex", "input": [], "max_output_tokens": 1, "store": False, "stream": False,
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "low"}, "prompt_cache_key": "conv-1", "client_metadata": {"x": 1}}
    reply = httpx.post(api_server.v1 + "/responses", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["usage"]["output_tokens"] == 1 and data["agentfold"]["session_id"] == "conv-1"
    assert data["store"] is False and data["previous_response_id"] is None


def test_previous_response_id_is_the_whole_conversation(client):
    first_input = "My name is Ada. Say hello to me."
    first = client.responses.create(model="gpt-5-codex", input=first_input, instructions="Be brief.",
                                    max_output_tokens=5)
    assert first.store is True
    follow = client.responses.create(model="gpt-5-codex", input="What is my name?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=5)
    assert follow.previous_response_id == first.id
    # the same conversation sent whole: same prompt, same (greedy) reply
    whole = client.responses.create(model="gpt-5-codex", instructions="Be brief.", max_output_tokens=5, store=False, input=[
        {"role": "user", "content": first_input},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "What is my name?"}])
    assert follow.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens + 10
    assert follow.output_text == whole.output_text
    # and a chain of three, through the second response
    third = client.responses.create(model="gpt-5-codex", input=[{"role": "user", "content": "Thanks."}],
                                    previous_response_id=follow.id, max_output_tokens=2)
    assert third.usage.input_tokens > follow.usage.input_tokens + 5


@pytest.mark.parametrize("stored", [False, None])
def test_unknown_previous_response_id_is_a_400(client, stored):
    previous = "resp_unknown"
    if stored is False:  # a response made with store: false is not kept
        previous = client.responses.create(model="gpt-5-codex", input="Hi.", store=False, max_output_tokens=1).id
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="gpt-5-codex", input="Again.", previous_response_id=previous,
                                max_output_tokens=1)
    error = caught.value.body
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert f"'{previous}' not found" in error["message"] and "send the whole conversation" in error["message"]


@pytest.mark.parametrize("item", [
    {"role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"},
                                 {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
    {"type": "function_call_output", "call_id": "c1",
     "output": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
])
def test_image_input_is_a_400(client, item):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="gpt-5-codex", input=[item], max_output_tokens=1)
    assert "is a part of type 'input_image', but the served model is text-only" in caught.value.body["message"]
    assert caught.value.body["code"] == "unsupported_content"


def test_response_store_is_bounded_and_refuses_broken_chains():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    store.put("r1", None, [{"role": "user", "content": "a"}], "s1")
    store.put("r2", "r1", [{"role": "user", "content": "b"}], "s1")
    assert store.conversation("r2") == ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "s1")
    store.put("x1", None, [], None)
    store.put("r3", "r2", [{"role": "user", "content": "c"}], "s1")  # over three: the least recently used goes
    assert len(store) == 3 and store.conversation("r1") == ([{"role": "user", "content": "a"}], "s1")
    assert store.conversation("r3") is None  # r2 is gone, so the chain is broken: refused, never served half
    store.put("big", None, [{"content": "x" * 20_000}], None)  # larger than the whole store: not kept
    assert store.conversation("big") is None and len(store) == 3
