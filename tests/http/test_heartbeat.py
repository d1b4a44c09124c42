"""A long prefill is not a silent stream: each streaming API sends its keep-alive while nothing is committed.

Claude Code drops a stream that sends no byte for 300 s and retries it from scratch (so a first
turn whose prefill takes longer never finishes); Codex has the same idle timeout. With the
heartbeat made short, a streamed request whose prompt takes a while to prefill must show the
keep-alive (Anthropic `ping`, an SSE comment, Responses `response.in_progress`) before its first
content, and still end with the same reply as a non-streamed one.
"""

from __future__ import annotations

import httpx
import pytest

from agentfold.http import stream as stream_module
from tests.helpers.api_helpers import MODEL_ID, api_server  # noqa: F401  (fixture)

LONG = "Summarize this log in one sentence.\n" + "\n".join(f"line {i}: request served in {i % 7} ms" for i in range(60))


@pytest.fixture
def quick_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "HEARTBEAT_S", 0.05)


def raw_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def first_index(lines: list[str], predicate) -> int:
    return next(i for i, line in enumerate(lines) if predicate(line))


def test_anthropic_stream_pings_while_prefilling(api_server, quick_heartbeat):  # noqa: F811
    lines = raw_lines(api_server.url + "/v1/messages", {"model": MODEL_ID, "max_tokens": 8, "stream": True,
                                                        "messages": [{"role": "user", "content": LONG}]})
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]
    content = events.index("content_block_start")
    assert events[2:content].count("ping") >= 2, events[:content + 1]  # beats while prefilling
    assert events[-1] == "message_stop"


def test_chat_stream_sends_comments_while_prefilling(api_server, quick_heartbeat):  # noqa: F811
    lines = raw_lines(api_server.url + "/v1/chat/completions", {"model": MODEL_ID, "max_tokens": 8, "stream": True,
                                                                "messages": [{"role": "user", "content": LONG}]})
    comments = [i for i, line in enumerate(lines) if line.startswith(": keep-alive")]
    first_text = first_index(lines, lambda line: '"content":"' in line and '"content":""' not in line)
    assert len([i for i in comments if i < first_text]) >= 2
    assert lines[-1] == "data: [DONE]"


def test_responses_stream_stays_in_progress_while_prefilling(api_server, quick_heartbeat):  # noqa: F811
    lines = raw_lines(api_server.url + "/v1/responses", {"model": MODEL_ID, "max_output_tokens": 8, "stream": True,
                                                         "input": LONG})
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    first_item = events.index("response.output_item.added")
    assert events[:first_item].count("response.in_progress") >= 3, events[:first_item + 1]
    assert events[-1] == "response.completed"
