"""A prompt head shared by new conversations, over real HTTP on the real SmolLM2 (torch).

Agents open every new conversation with the same system prompt and tools. The server keeps the
head's cache as a snapshot: a second new conversation restores it (in the same server and after a
restart), and four conversations sent at once prefill it once, the other three waiting for its
snapshot. Every reply equals the one a fresh server with an empty home gives the same request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import MODEL_ID, ServerThread

RULES = "\n".join(f"- Rule {i}: keep function {i} pure, typed and under {10 + i} lines." for i in range(30))
SYSTEM = {"role": "system", "content": "You are a careful Python reviewer. House rules:\n" + RULES}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
QUESTIONS = ["What does rule 3 ask?", "Which rule limits function 7?", "Summarize rules 1 and 2.",
             "Does any rule mention classes?", "What is rule 12?"]


class Server:
    def __init__(self, engine, home) -> None:
        self.service = Service(Runtime(engine, MODEL_ID, aliases=("smollm2",)), home=home)
        self.thread = ServerThread(build_app(self.service)).start()
        self.client = openai.OpenAI(base_url=self.thread.url + "/v1", api_key="x", max_retries=0, timeout=300)

    def ask(self, question: str) -> dict:
        reply = self.client.chat.completions.create(
            model="smollm2", messages=[SYSTEM, {"role": "user", "content": question}], tools=TOOLS, max_tokens=10,
            temperature=0)
        return reply.model_extra["agentfold"]

    def close(self) -> None:
        self.thread.stop()
        self.service.close()


@pytest.fixture(scope="module")
def references(smollm2_engine, tmp_path_factory) -> dict[str, str]:
    """Each question's reply (token sha) from a fresh server per question: nothing shared."""
    out = {}
    for question in QUESTIONS:
        server = Server(smollm2_engine, tmp_path_factory.mktemp("fresh"))
        try:
            block = server.ask(question)
        finally:
            server.close()
        assert block["cached_tokens"] == 0
        out[question] = block["token_sha"]
    return out


def test_second_conversation_and_restart_restore_the_head(smollm2_engine, tmp_path, references):
    server = Server(smollm2_engine, tmp_path)
    try:
        first = server.ask(QUESTIONS[0])
        second = server.ask(QUESTIONS[1])
    finally:
        server.close()
    assert first["head_tokens"] == 0 and first["cached_tokens"] == 0
    head = second["head_tokens"]
    assert head > 0 and second["cached_tokens"] == head < second["prompt_tokens"]
    assert first["token_sha"] == references[QUESTIONS[0]] and second["token_sha"] == references[QUESTIONS[1]]

    restarted = Server(smollm2_engine, tmp_path)
    try:
        third = restarted.ask(QUESTIONS[2])
        restarted.service.telemetry.flush()
        row = restarted.service.telemetry.get_turn(third["turn_id"])
    finally:
        restarted.close()
    assert third["head_tokens"] == head and third["token_sha"] == references[QUESTIONS[2]]
    assert row["head_tokens"] == head and row["cached_tokens"] == head  # the SQLite row says so too


def test_conversations_sent_at_once_prefill_the_head_once(smollm2_engine, tmp_path, references):
    server = Server(smollm2_engine, tmp_path)
    questions = QUESTIONS[1:5]
    try:
        with ThreadPoolExecutor(len(questions)) as pool:
            blocks = list(pool.map(server.ask, questions))
        lanes = server.service.runtime.lanes
    finally:
        server.close()
    heads = sorted(block["head_tokens"] for block in blocks)
    owner = [block for block in blocks if block["head_tokens"] == 0]
    assert len(owner) == 1 and owner[0]["cached_tokens"] == 0  # one conversation prefilled it
    assert heads[1] > 0 and heads[1:] == [heads[1]] * 3, heads  # the other three restored it
    for question, block in zip(questions, blocks, strict=True):
        assert block["token_sha"] == references[question], question
    assert lanes.passes > 0 and max(lanes.by_lanes) > 1  # the three after the head shared passes
