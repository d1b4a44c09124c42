"""Claude Code's own requests, recorded (tests/fixtures/claude_code/), replayed against the real server.

The fixture holds what Claude Code 2.1.332 sent for a two-turn task (`claude -p`, then
`claude -p --continue`), four requests: ~12.5K-token prompts (a 7K-character system prompt, 12
tools, a `system` message after the first user message), `max_tokens: 128000`, `thinking`,
`context_management`, `output_config`, `metadata.user_id` and the `X-Claude-Code-Session-Id`
header. They are longer than SmolLM2's 8K context, so the model here is a tiny random model of
SmolLM2's real architecture (llama) with SmolLM2's own tokenizer and chat template and a 32K
context: the prompt is rendered, tokenized, cached and resumed exactly as SmolLM2 would have it.
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

FIXTURE = Path(__file__).parents[1] / "fixtures" / "claude_code" / "two_turns.json"
RECORDED = json.loads(FIXTURE.read_text())
REQUESTS = [request for turn in RECORDED["turns"] for request in turn["requests"]]
REPLAYED_HEADERS = ("user-agent", "x-claude-code-session-id", "anthropic-beta", "anthropic-version", "x-app")


ROOM = 8  # tokens each reply gets: the context is set this far above each recorded prompt


@pytest.fixture(scope="module")
def served(smollm2_folder, tmp_path_factory):
    """The full stack (sessions in SQLite) on the tiny 32K model, and each recorded prompt's length."""
    # one layer, not two: the 12.5K-token first prefill is what this test's time goes to
    folder = tiny_smollm2_folder(tmp_path_factory.mktemp("tiny-smollm2") / "model", smollm2_folder, layers=1)
    engine = build_engine(folder, drafter="none", backend=real_model_backend())  # exactness is not under test here: no self-check
    service = Service(Runtime(engine, "tiny-smollm2"), home=tmp_path_factory.mktemp("home"))
    server = ServerThread(build_app(service)).start()
    try:
        counts = [httpx.post(server.url + "/v1/messages/count_tokens", timeout=60,
                             json={k: request["body"][k] for k in ("model", "system", "messages", "tools")})
                  .json()["input_tokens"] for request in REQUESTS]
        yield server, service.runtime, counts
    finally:
        server.stop()
        service.close()


def replay(url: str, request: dict) -> list[tuple[str, dict]]:
    """POST one recorded request as Claude Code sent it; the (event, data) pairs of its SSE answer."""
    headers = {k: v for k, v in request["headers"].items() if k.lower() in REPLAYED_HEADERS}
    with httpx.stream(request["method"], url + request["path"], json=request["body"], headers=headers,
                      timeout=300) as response:
        assert response.status_code == 200, response.read().decode()
        lines = [line for line in response.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    return list(zip(names, data, strict=True))


@pytest.fixture(scope="module")
def replayed(served):
    """Each request replayed in order, the context set `ROOM` tokens above its prompt: Claude Code's
    `max_tokens: 128000` is clamped to that, and the random model's replies stay short."""
    server, runtime, counts = served
    answers = []
    for request, prompt in zip(REQUESTS, counts, strict=True):
        runtime.context_length = prompt + ROOM
        answers.append(replay(server.url, request))
    return answers


def test_fixture_is_claude_code_as_shipped():
    assert RECORDED["claude_code_version"] == "2.1.332"
    first = REQUESTS[0]
    assert first["path"] == "/v1/messages?beta=true" and first["body"]["max_tokens"] > 32768
    assert [m["role"] for m in first["body"]["messages"]] == ["user", "system"]
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(first["body"])


def test_each_request_answered_with_the_full_event_sequence(replayed):
    for events in replayed:
        names = [name for name, _ in events]
        assert names[:3] == ["message_start", "ping", "content_block_start"], names
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
        assert all(data["type"] == name for name, data in events)


def test_session_is_claude_codes_own(replayed):
    session = REQUESTS[0]["headers"]["X-Claude-Code-Session-Id"]
    for events in replayed:
        assert dict(events)["message_delta"]["agentfold"]["session_id"] == session


def test_max_tokens_clamped_to_the_context(replayed, served):
    *_, counts = served
    for events, prompt in zip(replayed, counts, strict=True):
        clamp = dict(events)["message_delta"]["agentfold"]["max_tokens_clamped"]
        assert clamp == {"requested": 128000, "granted": ROOM, "prompt_tokens": prompt, "context_length": prompt + ROOM}


def test_later_requests_reuse_the_session_cache(replayed, served):
    *_, counts = served
    for events, prompt in list(zip(replayed, counts, strict=True))[1:]:
        usage = dict(events)["message_delta"]["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
        assert usage["cache_read_input_tokens"] >= 0.95 * prompt, usage
