"""OpenAI Chat Completions and Completions through the official `openai` client, on a real server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from tests.helpers.api_helpers import MODEL_ID, api_server, wait_idle  # noqa: F401  (fixture)

HELLO = [{"role": "user", "content": "Say hello to Ada."}]
COPY = ("Repeat this line exactly: the quick brown fox jumps over the lazy dog, "
        "the quick brown fox jumps over the lazy dog.")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time.",
                                         "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client(api_server) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hello(client):
    """One non-streaming reply, shared by the tests that compare against it."""
    return client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8)


def sse_events(response: httpx.Response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_streaming(hello):
    assert hello.object == "chat.completion" and hello.model == "smollm2"
    choice = hello.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    usage = hello.usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    extra = hello.model_extra
    assert {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n",
            "draft_n_accepted"} <= set(extra["timings"])
    block = extra["agentfold"]
    assert len(block["token_sha"]) == 64 and block["completion_tokens"] == 8
    assert {"drafted", "accepted", "tokens_per_pass", "ttft_ms", "decode_tps", "draft_method", "exactness"} <= set(block)
    lanes = block["lanes"]  # how its verify passes were run: alone here, one reply per pass
    assert lanes["replies_per_pass"] == 1.0 and lanes["shared_passes"] == 0 and lanes["rows_per_pass"] >= 1


def test_chat_streaming_equals_non_streaming(client, hello):
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hello.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert finals[0].model_extra["agentfold"]["token_sha"] == hello.model_extra["agentfold"]["token_sha"]
    assert "timings" in finals[0].model_extra
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 0


def test_no_usage_chunk_unless_asked(api_server):  # noqa: F811
    body = {"model": "gpt-4o", "messages": HELLO, "max_completion_tokens": 3, "stream": True}
    with httpx.stream("POST", api_server.v1 + "/chat/completions", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(len(c["choices"]) == 1 for c in chunks)  # `chunk.choices[0]` loops must not break
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]


def test_draft_false_equals_drafted(client):
    messages = [{"role": "user", "content": COPY}]
    drafted = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24)
    serial = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24,
                                            extra_body={"draft": False})
    assert serial.choices[0].message.content == drafted.choices[0].message.content
    a, b = drafted.model_extra["agentfold"], serial.model_extra["agentfold"]
    assert a["token_sha"] == b["token_sha"]
    assert b["draft_method"] == "none" and b["drafted"] == 0
    assert a["draft_method"] == "suffix"


def test_predicted_output_equals_serial_and_counts_its_tokens(api_server, client):  # noqa: F811
    """OpenAI's `prediction` (as the official client sends it): the reply is the serial one, streamed
    and not; usage says how much of the prediction the reply kept; a malformed one is a 400."""
    messages = [{"role": "user", "content": "Print this file again with mul renamed to times:\n"
                 "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"}]
    serial = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40,
                                            extra_body={"draft": False})
    text = serial.choices[0].message.content
    predicted = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40,
                                               prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    block = predicted.model_extra["agentfold"]
    assert block["token_sha"] == serial.model_extra["agentfold"]["token_sha"] and block["draft_method"] == "prediction"
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == block["accepted"] > predicted.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens == block["drafted"] - block["accepted"]
    assert serial.usage.completion_tokens_details.accepted_prediction_tokens == 0
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": parts})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    for bad in ({"type": "text", "content": text}, {"type": "content", "content": [{"type": "image"}]}, "text"):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, prediction=bad)
        assert "prediction" in error.value.body["param"]


def test_same_seed_same_sample(client):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
                  temperature=1.0, top_p=0.95, seed=11)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs, extra_body={"audit": True})
    assert first.choices[0].message.content == again.choices[0].message.content
    block = again.model_extra["agentfold"]
    assert block["audit"] == ("skipped" if block["draft_method"] == "none" else "passed")


def test_stop_string(client, hello):
    text = hello.choices[0].message.content
    cut = text.split()[1] if len(text.split()) > 1 else text[-2:]
    reply = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8, stop=[cut])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == text[: text.index(cut)]


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=48)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments.get("city"), str) and arguments["city"]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C"}]
    final = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME], max_tokens=12,
                                           tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_streamed_tool_call_deltas(api_server):  # noqa: F811
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 48, "stream": True, "parallel_tool_calls": False}
    seen = []
    api_server.runtime.after_response = lambda turn: seen.append({"finish_reason": turn.finish_reason,
                                                                         "tool_calls": turn.tool_calls})
    try:
        with httpx.stream("POST", api_server.v1 + "/chat/completions", json=body, timeout=120) as response:
            chunks = sse_events(response)[:-1]
    finally:
        api_server.runtime.after_response = None
    assert seen == [{"finish_reason": "tool_calls", "tool_calls": 1}]  # the telemetry hook sees the API outcome
    elements = [e for c in chunks for e in (c["choices"][0]["delta"].get("tool_calls") or [])]
    assert elements and all("index" in e for e in elements)
    assert "id" in elements[0] and elements[0]["function"]["name"] == "get_weather"
    assert all("id" not in e and "name" not in e.get("function", {}) for e in elements[1:])
    arguments = "".join(e["function"].get("arguments", "") for e in elements)
    assert json.loads(arguments)["city"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_concurrent_clients_each_equal_serial(client):
    prompts = ["Name a color.", "Name an animal.", "Name a city.", "Name a number."]

    def ask(prompt: str, draft: bool) -> str:
        reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=10, extra_body={"draft": draft})
        return reply.choices[0].message.content

    serial = [ask(p, False) for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            results[index] = ask(prompts[index], True)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors
    assert [results[i] for i in range(len(prompts))] == serial


def test_disconnect_mid_stream_is_dropped(api_server, client):  # noqa: F811
    runtime = api_server.runtime
    cancelled = runtime.counters["cancelled"]
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", api_server.v1 + "/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first real token: now hang up
    assert wait_idle(runtime, timeout=30)
    assert runtime.counters["cancelled"] == cancelled + 1
    started = time.monotonic()
    reply = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.content and time.monotonic() - started < 60


def test_json_mode_and_session_header(api_server, client):  # noqa: F811
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object with keys name and age."}],
        max_tokens=20, response_format={"type": "json_object"}, extra_headers={"X-Session-Id": "s-42"})
    content = reply.choices[0].message.content
    assert content.startswith("{")  # the reply is opened as an object (grammar constraints will finish the job)
    assert reply.model_extra["agentfold"]["session_id"] == "s-42"


def test_completions(client):
    reply = client.completions.create(model="smollm2", prompt="def add(a, b):\n    return", max_tokens=6)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="smollm2", prompt="def add(a, b):\n    return", max_tokens=6,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_health_and_head(api_server, client):  # noqa: F811
    listing = client.models.list()
    ids = [m.id for m in listing.data]
    assert ids == [MODEL_ID] and "smollm2" in listing.data[0].model_extra["aliases"]
    raw = httpx.get(api_server.v1 + "/models").json()
    assert raw["models"][0]["slug"] == MODEL_ID and raw["models"][0]["context_window"] == 8192
    health = httpx.get(api_server.url + "/health").json()
    assert health["status"] == "ok" and health["lanes"]["width"] == 64 and "stages" not in health
    assert "lanes on" in health["exactness"]
    assert httpx.head(api_server.url + "/").status_code == 200
    assert httpx.get(api_server.v1 + "/models/claude-sonnet-4-5").json()["id"] == "claude-sonnet-4-5"


def test_image_and_audio_parts_are_a_400_naming_the_part(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    for part in (image, audio):
        messages = [{"role": "system", "content": "Be terse."},
                    {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        error = caught.value.body
        assert caught.value.status_code == 400 and error["param"] == "messages[1].content[1]"
        assert error["type"] == "invalid_request_error" and part["type"] in error["message"]
        assert "text-only" in error["message"]


def _entries(reply) -> list[dict]:
    return [e.model_dump() for e in reply.choices[0].logprobs.content]


def test_chat_logprobs_are_the_models_distribution(client):
    reply = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8, logprobs=True,
                                           top_logprobs=3)
    entries = _entries(reply)
    assert len(entries) == reply.usage.completion_tokens == 8
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == reply.choices[0].message.content
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert entry["logprob"] <= 0 and sum(np.exp(t["logprob"]) for t in top) <= 1 + 1e-9
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy: the top one
    plain = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8)
    assert plain.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=8, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == entries


def test_drafted_logprobs_equal_serial_bit_for_bit(client):
    messages = [{"role": "user", "content": COPY}]
    kwargs = dict(model="smollm2", messages=messages, max_tokens=24, logprobs=True, top_logprobs=2)
    drafted = client.chat.completions.create(**kwargs)
    serial = client.chat.completions.create(**kwargs, extra_body={"draft": False})
    assert drafted.model_extra["agentfold"]["drafted"] > 0  # drafting really ran
    assert serial.model_extra["agentfold"]["drafted"] == 0
    assert _entries(drafted) == _entries(serial) and len(_entries(drafted)) > 0


def test_logprob_fields_are_checked(api_server):  # noqa: F811
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                  "top_logprobs"), ({"logprobs": 3}, "logprobs")):
        body = {"model": "m", "messages": HELLO, "max_tokens": 2, **extra}
        response = httpx.post(api_server.v1 + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_completions_logprobs(client):
    prompt = "def add(a, b):\n    return"
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, logprobs=2)
    block = reply.choices[0].logprobs
    assert "".join(block.tokens) == reply.choices[0].text and len(block.token_logprobs) == 6
    assert all(lp <= 0 for lp in block.token_logprobs)
    assert all(0 < len(top) <= 2 and max(top.values()) == lp for top, lp in zip(block.top_logprobs,
                                                                             block.token_logprobs, strict=True))
    assert block.text_offset == [sum(len(t) for t in block.tokens[:i]) for i in range(6)]
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, logprobs=2, stream=True))
    assert [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs] == \
        block.token_logprobs
