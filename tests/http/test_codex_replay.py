"""Codex CLI's own requests, recorded (tests/fixtures/codex/), replayed against the real server.

The fixture holds what Codex 0.171.0 sent for a two-turn task (`codex exec --profile agentfold`
with the files `agentfold integrate codex --scope user` writes): a ~6.5K-token prompt of two
`developer` messages, the environment and the task, 12 tools (function tools, a `namespace` of
sub-agent tools, hosted `web_search`), `store: false`, `reasoning`, `include`, `client_metadata`,
`prompt_cache_key`; then the same again with the `exec_command` call and its output appended.
The model is a tiny random llama with SmolLM2's tokenizer and chat template and a 32K context
(tests/helpers/long_context.py): the prompt is rendered, tokenized, cached and resumed exactly as
SmolLM2 would have it. Replies are capped at 16 tokens by the server's default budget, since
Codex names none.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agentfold.engine.factory import build_engine
from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import ServerThread
from tests.helpers.backends import real_model_backend
from tests.helpers.long_context import tiny_smollm2_folder

FIXTURES = Path(__file__).parents[1] / "fixtures" / "codex"
RECORDED = json.loads((FIXTURES / "requests.json").read_text())
TURNS = [json.loads((FIXTURES / f"turn{n}.json").read_text()) for n in (1, 2)]
REPLAYED_HEADERS = ("user-agent", "originator", "session-id", "thread-id", "x-client-request-id", "accept")


@pytest.fixture(scope="module")
def served(smollm2_folder, tmp_path_factory):
    """The full stack (sessions in SQLite) on the tiny 32K model."""
    folder = tiny_smollm2_folder(tmp_path_factory.mktemp("tiny-smollm2") / "model", smollm2_folder)
    service = Service(Runtime(build_engine(folder, backend=real_model_backend()), "tiny-smollm2"), home=tmp_path_factory.mktemp("home"))
    server = ServerThread(build_app(service, default_max_tokens=16)).start()
    try:
        yield server
    finally:
        server.stop()
        service.close()


def replay(url: str, body: dict, headers: dict[str, str] | None = None) -> list[dict]:
    """POST one Responses request as Codex sends it; the events of its SSE answer (names checked)."""
    with httpx.stream("POST", url + "/v1/responses", json=body, headers=headers or {}, timeout=300) as response:
        assert response.status_code == 200, response.read().decode()
        lines = [line for line in response.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in events]
    return events


@pytest.fixture(scope="module")
def replayed(served):
    requests = RECORDED["requests"]
    return [replay(served.url, body, {k: v for k, v in requests[f"turn{n}"]["headers"].items()
                                      if k in REPLAYED_HEADERS})
            for n, body in enumerate(TURNS, 1)]


def test_fixture_is_codex_as_shipped():
    assert RECORDED["codex_version"] == "0.171.0"
    assert RECORDED["requests"]["turn1"]["headers"]["user-agent"].startswith("codex_exec/0.171.0")
    first, second = TURNS
    assert first["store"] is False and first["stream"] is True and "instructions" not in first
    assert {t["type"] for t in first["tools"]} == {"function", "namespace", "web_search"}
    assert [item.get("role") for item in first["input"]] == ["developer", "developer", "user", "user"]
    assert second["input"][:4] == first["input"]
    assert [item["type"] for item in second["input"][4:]] == ["function_call", "function_call_output"]
    text = json.dumps(TURNS) + json.dumps(RECORDED)
    assert "/home/user/project" in text and "/tmp/" not in text  # scrubbed


def test_each_request_answered_with_a_valid_event_sequence(replayed):
    for events in replayed:
        kinds = [event["type"] for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert added and added == [e["output_index"] for e in done]
        final = events[-1]["response"]
        assert final["output"] == [e["item"] for e in done] and final["store"] is False
        assert final["usage"]["output_tokens"] == 16 and final["status"] == "incomplete"


def test_session_is_codexs_conversation(replayed):
    for events, body in zip(replayed, TURNS, strict=True):
        assert events[-1]["response"]["agentfold"]["session_id"] == body["prompt_cache_key"]


def test_second_turn_reuses_the_cache(replayed):
    first, second = (events[-1]["response"]["usage"] for events in replayed)
    assert first["input_tokens"] > 6000  # Codex's first prompt alone: too much for an 8K model with replies
    assert second["input_tokens"] > first["input_tokens"]
    assert second["input_tokens_details"]["cached_tokens"] >= 0.95 * second["input_tokens"], second


def test_previous_response_id_follows_the_recorded_conversation(served, replayed):
    """The same two turns sent the other way: turn 1 stored, turn 2 as only its new items."""
    first, second = TURNS
    stored = {**first, "store": True}
    del stored["prompt_cache_key"]  # no key: the session must follow the response id
    head = replay(served.url, stored)[-1]["response"]
    follow = {**second, "store": True, "previous_response_id": head["id"], "input": second["input"][4:]}
    del follow["prompt_cache_key"]
    tail = replay(served.url, follow)[-1]["response"]
    assert tail["previous_response_id"] == head["id"] and tail["store"] is True
    assert tail["agentfold"]["session_id"] == head["agentfold"]["session_id"]
    usage = tail["usage"]
    assert usage["input_tokens"] > head["usage"]["input_tokens"] + 50  # turn 1, its reply and the new items
    assert usage["input_tokens_details"]["cached_tokens"] >= 0.95 * usage["input_tokens"], usage
