"""The full serving stack over real HTTP: sessions resume (and equal fresh), telemetry rows, /metrics, audits."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import MODEL_ID, ServerThread, wait_idle

SOURCE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40))
TURN1 = [{"role": "user", "content": f"Here is a module:\n```python\n{SOURCE}```\nWhat does f3 return?"}]


def serve(engine, home):
    service = Service(Runtime(engine, MODEL_ID, aliases=("smollm2",)), home=home)
    return service, ServerThread(build_app(service)).start()


@pytest.fixture(scope="module")
def stack(smollm2_engine, tmp_path_factory):
    service, server = serve(smollm2_engine, tmp_path_factory.mktemp("home"))
    yield service, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300), server
    server.stop()
    service.close()


def chat(client, messages, session: str | None = None, **extra):
    headers = {"X-Session-Id": session} if session else None
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                          extra_headers=headers, extra_body=extra or None)


@pytest.mark.slow
def test_second_turn_resumes_and_equals_fresh(stack, smollm2_engine, tmp_path):
    service, client, _ = stack
    first = chat(client, TURN1, session="s-1")
    turn2 = [*TURN1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And f4?"}]
    second = chat(client, turn2, session="s-1")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached < second.usage.prompt_tokens
    assert second.model_extra["timings"]["cache_n"] == cached

    fresh_service, fresh_server = serve(smollm2_engine, tmp_path / "fresh")
    try:
        fresh = openai.OpenAI(base_url=fresh_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        reference = chat(fresh, turn2)
        assert reference.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        fresh_server.stop()
        fresh_service.close()
    assert second.choices[0].message.content == reference.choices[0].message.content
    assert second.model_extra["agentfold"]["token_sha"] == reference.model_extra["agentfold"]["token_sha"]


READ_FILE = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                              "required": ["path"], "additionalProperties": False}}}


@pytest.mark.slow
def test_turn_after_a_forced_tool_call_reuses_the_cache(stack, smollm2_engine, tmp_path):
    """The forced-call instruction is a turn of its own after the history, so the next turn (whose
    history lacks it) restores the snapshot taken before it, and still equals a fresh server."""
    _, client, _ = stack
    turn1 = [{"role": "system", "content": "You are a coding agent.\n" + SOURCE},
             {"role": "user", "content": "Open the module file, please."}]
    first = client.chat.completions.create(
        model="smollm2", messages=turn1, tools=[READ_FILE], max_tokens=60, extra_headers={"X-Session-Id": "s-tool"},
        tool_choice={"type": "function", "function": {"name": "read_file"}})
    call = first.choices[0].message.tool_calls[0]
    turn2 = [*turn1, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": SOURCE[:400]}]
    second = client.chat.completions.create(model="smollm2", messages=turn2, tools=[READ_FILE], max_tokens=12,
                                            extra_headers={"X-Session-Id": "s-tool"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 40, (cached, first.usage.prompt_tokens)

    fresh_service, fresh_server = serve(smollm2_engine, tmp_path / "fresh")
    try:
        fresh = openai.OpenAI(base_url=fresh_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        reference = fresh.chat.completions.create(model="smollm2", messages=turn2, tools=[READ_FILE], max_tokens=12)
    finally:
        fresh_server.stop()
        fresh_service.close()
    assert second.model_extra["agentfold"]["token_sha"] == reference.model_extra["agentfold"]["token_sha"]


def test_a_prefill_whose_client_left_is_kept_for_its_retry(stack, smollm2_engine, tmp_path):
    """Claude Code gives up on a request after API_TIMEOUT_MS and sends it again: on a slow machine its
    first turn's prefill started over on every retry. The chunks a cancelled turn prefilled are kept
    (a snapshot at the plan boundary it reached), the retry resumes there, and still equals a fresh server."""
    service, client, server = stack
    runtime = service.runtime
    source = "\n".join(f"def g{i}(x):\n    return x * {i} - {i * 3}\n" for i in range(150))
    messages = [{"role": "user", "content": f"```python\n{source}```\nWhich function returns x * 7 - 21?"}]
    prompt_tokens = len(service.sessions.render(messages)[0])
    assert prompt_tokens > 2500  # several chunks of the plan: the client leaves after the first
    cancelled = runtime.counters["cancelled"]
    body = {"model": "smollm2", "max_tokens": 8, "stream": True, "messages": messages}
    with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body,
                                                        headers={"X-Session-Id": "s-gone"}):
        deadline = time.monotonic() + 120
        while not any(t.session is not None and t.session.cache.length >= 512 for t in runtime.running()):
            assert time.monotonic() < deadline, "the prefill never reached its first chunk"
            time.sleep(0.01)
    assert wait_idle(runtime) and runtime.counters["cancelled"] == cancelled + 1
    retry = chat(client, messages, session="s-gone")
    cached = retry.usage.prompt_tokens_details.cached_tokens
    assert 512 <= cached < prompt_tokens - 512 and cached % 512 == 0, cached  # a chunk boundary, short of the end

    fresh_service, fresh_server = serve(smollm2_engine, tmp_path / "fresh")
    try:
        reference = chat(openai.OpenAI(base_url=fresh_server.url + "/v1", api_key="x", max_retries=0, timeout=300),
                         messages)
    finally:
        fresh_server.stop()
        fresh_service.close()
    assert retry.model_extra["agentfold"]["token_sha"] == reference.model_extra["agentfold"]["token_sha"]


def test_telemetry_rows_match_responses(stack):
    service, client, _ = stack
    reply = chat(client, [{"role": "user", "content": "Name a color."}], session="s-2")
    block = reply.model_extra["agentfold"]
    service.telemetry.flush()
    row = service.telemetry.get_turn(block["turn_id"])
    assert row["session_id"] == "s-2" and row["api"] == "chat"
    assert row["completion_tokens"] == reply.usage.completion_tokens
    assert row["prompt_tokens"] == reply.usage.prompt_tokens
    assert row["token_sha"] == block["token_sha"]
    assert row["finish_reason"] == reply.choices[0].finish_reason
    assert row["inputs"]["reply"] and row["inputs"]["prompt"]
    assert [t["turn_id"] for t in service.telemetry.list_turns(session_id="s-2")] == [block["turn_id"]]


def test_audits_pass_inline_and_later(stack):
    service, client, _ = stack
    reply = chat(client, [{"role": "user", "content": "Repeat: one two three, one two three."}], audit=True,
                 temperature=0.7, seed=3)
    block = reply.model_extra["agentfold"]
    assert block["audit"] in ("passed", "skipped")  # skipped when nothing was drafted
    service.telemetry.flush()
    verdict = asyncio.run(service.audit_turn(block["turn_id"]))
    assert verdict["verdict"] == "passed" and verdict["mismatch_position"] is None
    service.telemetry.flush()
    assert service.telemetry.get_turn(block["turn_id"])["audit"] == "passed"


def test_metrics_count_the_turns_served(stack):
    service, client, server = stack
    first = [{"role": "user", "content": "Name a tree."}]
    reply = chat(client, first, session="s-metrics")
    chat(client, [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "And a flower?"}], session="s-metrics")  # a resumed turn: cache hits
    service.telemetry.flush()
    rows = service.telemetry.list_turns(limit=1000)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    generated = sum(s.value for s in families["agentfold:generation_tokens"].samples if s.name.endswith("_total"))
    prompt = sum(s.value for s in families["agentfold:prompt_tokens"].samples if s.name.endswith("_total"))
    assert generated == sum(r["completion_tokens"] for r in rows)
    assert prompt == sum(r["prompt_tokens"] for r in rows)
    hits = sum(s.value for s in families["agentfold:prefix_cache_hits"].samples if s.name.endswith("_total"))
    assert hits == sum(r["cached_tokens"] for r in rows) and hits > 0


def test_dashboard_is_self_contained_and_serves_the_rows(stack):
    service, _, server = stack
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "<svg" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    data = httpx.get(server.url + "/dashboard/turns.json").json()
    service.telemetry.flush()
    assert len(data["turns"]) == len(service.telemetry.list_turns(limit=200))
    assert data["summary"]["turns"] == len(data["turns"])
