"""The runtime under the HTTP layer: fair interleaving, cancellation, queueing, chat rendering and
tool-call parsing (streamed piece by piece equals parsed at once)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from agentfold.chat.template import render_chat
from agentfold.chat.tool_calls import TextPiece, ToolCallParser, parse_output
from agentfold.chat.tools import ToolCall, ToolSpec
from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.sampler import SamplingParams
from agentfold.serve.scheduler import Runtime, RuntimeClosed, TurnCancelled, TurnRequest
from tests.conftest import chat_ids

WEATHER = ToolSpec("get_weather", "Get the current weather for a city.",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


# --- tool-call parsing ------------------------------------------------------------------------

REPLIES = [
    "Just text, no calls at all.",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
    "<tool_call>\nnot json at all\n</tool_call>",
    'A < B and <tool is not a tag; <tool_call>{"name": "f", "arguments": {"q": "<tool_call>"}}',
    '<tool_call>\n{"name": "cut", "arguments": {"a": ',
    "text <tool_c",
]


def _settle(pieces):
    text = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls = [(c.name, json.loads(c.arguments)) for c in pieces if isinstance(c, ToolCall)]
    return text, calls


@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_parse_equals_whole_parse(reply):
    whole = ToolCallParser()
    expected = _settle(whole.feed(reply) + whole.finish())
    for size in (1, 2, 5):
        parser = ToolCallParser()
        pieces = []
        for start in range(0, len(reply), size):
            pieces += parser.feed(reply[start:start + size])
        pieces += parser.finish()
        assert _settle(pieces) == expected
        assert parser.content == whole.content


def test_parse_shapes():
    content, calls = parse_output(REPLIES[1])
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    content, calls = parse_output(REPLIES[2])
    assert content == "" and [c.name for c in calls] == ["a", "b"]  # parallel calls
    assert json.loads(parse_output(REPLIES[3])[1][0].arguments) == {"city": "Oslo"}  # arguments as a string
    content, calls = parse_output(REPLIES[4])
    assert calls == [] and "not json" in content  # an unparseable block is text
    assert parse_output(REPLIES[6])[1] == []  # cut off mid-JSON: not a call
    assert parse_output("plain", tools_enabled=False) == ("plain", [])
    assert parse_output(REPLIES[1], tools_enabled=False)[1] == []


def test_forced_prefix_is_parsed_as_output():
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    content, calls = parse_output('Rome"}}\n</tool_call>', prefix=prefix)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    # an unterminated block (stopped on </tool_call>) still parses when its JSON is complete
    assert parse_output('Rome"}}', prefix=prefix)[1][0].arguments_obj == {"city": "Rome"}


# --- chat rendering ---------------------------------------------------------------------------

def test_render_injects_tools_for_templates_without_them(smollm2_engine):
    tokenizer = smollm2_engine.tokenizer
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 22 C"},
    ]
    text = render_chat(tokenizer, messages, [WEATHER])
    assert "<tools>" in text and '"get_weather"' in text and '"city"' in text  # name, description, schema
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 22 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = render_chat(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert plain == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                  tokenize=False)


class _NativeToolsTokenizer:
    """A tokenizer whose template renders tools itself (like Qwen's): render_chat must defer to it."""

    chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}{% if tools %}tools{% endif %}"

    def __init__(self) -> None:
        self.seen = None

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False):
        self.seen = (messages, tools)
        return "native"


def test_render_uses_native_tool_templates():
    tokenizer = _NativeToolsTokenizer()
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert render_chat(tokenizer, messages, [WEATHER]) == "native"
    seen_messages, seen_tools = tokenizer.seen
    assert seen_tools[0]["function"]["name"] == "get_weather"
    assert seen_messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # templates want objects


# --- the worker -------------------------------------------------------------------------------

PROMPTS = ["Name a fruit.", "Count to five.", "What is 2+2?"]


@pytest.fixture(scope="module")
def references(smollm2_engine):
    """Serial replies of PROMPTS (greedy, 10 tokens)."""
    ids = [chat_ids(smollm2_engine.tokenizer, p) for p in PROMPTS]
    config = GenerationConfig(max_tokens=10, draft=False)
    return ids, [smollm2_engine.generate(i, config).tokens for i in ids]


def test_interleaved_turns_equal_serial(smollm2_engine, references):
    ids, expected = references
    runtime = Runtime(smollm2_engine, "m", max_active=2)
    try:
        turns = [runtime.submit(TurnRequest(i, GenerationConfig(max_tokens=10))) for i in ids]
        results = [t.result(timeout=120).tokens for t in turns]
        assert results == expected
        assert turns[2].queue_seconds > 0  # the third waited for a slot
        assert all(t.status == "done" for t in turns) and runtime.counters["completed"] == 3
        # the first two ran side by side: each one's first delta came before the other finished
        assert turns[0].first_delta_at < turns[1].finished_at and turns[1].first_delta_at < turns[0].finished_at
    finally:
        runtime.close()


def test_cancel_drops_a_turn_and_the_worker_goes_on(smollm2_engine, references):
    ids, expected = references
    runtime = Runtime(smollm2_engine, "m", max_active=1)
    try:
        running = runtime.submit(TurnRequest(ids[0], GenerationConfig(max_tokens=200)))
        waiting = runtime.submit(TurnRequest(ids[1], GenerationConfig(max_tokens=200)))
        waiting.cancel()
        running.cancel()
        for turn in (running, waiting):
            with pytest.raises(TurnCancelled):
                turn.result(timeout=60)
        assert running.completion is None and runtime.counters["cancelled"] == 2
        after = runtime.submit(TurnRequest(ids[2], GenerationConfig(max_tokens=10)))
        assert after.result(timeout=60).tokens == expected[2]
    finally:
        runtime.close()


def test_audit_and_hooks(smollm2_engine, references):
    ids, expected = references
    runtime = Runtime(smollm2_engine, "m")
    seen = []
    runtime.before_turn = lambda turn: seen.append(("before", turn.id, threading.current_thread().name))
    runtime.after_turn = lambda turn: seen.append(("after", turn.id, turn.completion is not None))
    try:
        params = SamplingParams(temperature=0.8, seed=3)
        turn = runtime.submit(TurnRequest(ids[0], GenerationConfig(params=params, max_tokens=10), audit=True))
        completion = turn.result(timeout=120)
        assert turn.audit in ("passed", "skipped")
        if completion.stats.draft_method != "none":
            assert turn.audit == "passed"
        assert seen == [("before", turn.id, "agentfold-runtime"), ("after", turn.id, True)]

        def broken(turn):
            raise RuntimeError("hook failed")

        runtime.before_turn = broken
        failing = runtime.submit(TurnRequest(ids[1], GenerationConfig(max_tokens=4)))
        with pytest.raises(RuntimeError, match="hook failed"):
            failing.result(timeout=60)
        runtime.before_turn = None
        assert runtime.submit(TurnRequest(ids[2], GenerationConfig(max_tokens=10))).result(60).tokens == expected[2]
    finally:
        runtime.close()


@pytest.mark.slow
def test_a_long_prefill_runs_in_scheduled_chunks(smollm2_engine, references):
    """A long prompt's prefill is scheduled step by step: one step per layer of each chunk, or, where
    prompts run as passes (these 32-row chunks, `Runtime.prompts_in_passes`), one pass per chunk,
    alone or riding in the short turn's passes. A short turn submitted after it finishes first, and
    both replies equal their solo serial runs (the chunks are the plan's, whoever runs between)."""
    ids, expected = references
    chunked = Engine(smollm2_engine.backend, smollm2_engine.tokenizer, smollm2_engine.eos_token_ids,
                     drafter=smollm2_engine.drafter, exactness=smollm2_engine.exactness, chunk_size=32)
    source = Path(__file__).read_text()[:2400]
    long_ids = chat_ids(chunked.tokenizer, "Repeat the first test function above exactly.", system=source)
    assert len(long_ids) > 16 * chunked.chunk_size
    config = GenerationConfig(max_tokens=16)
    solo = chunked.generate(long_ids, GenerationConfig(max_tokens=16, draft=False))
    runtime = Runtime(chunked, "m", max_active=2)
    try:
        long_turn = runtime.submit(TurnRequest(long_ids, config))
        short_turn = runtime.submit(TurnRequest(ids[1], GenerationConfig(max_tokens=10)))
        assert short_turn.result(timeout=120).tokens == expected[1]
        drafted = long_turn.result(timeout=300)
    finally:
        runtime.close()
    assert drafted.tokens == solo.tokens and drafted.stats.drafted > 0
    steps = 1 if runtime.prompts_in_passes else len(chunked.backend.new_cache().layers)  # per chunk
    assert long_turn.prefill_passes == (len(chunked.plan(0, len(long_ids) - 1)) + 1) * steps
    assert short_turn.finished_at < long_turn.first_delta_at  # it ran between the long prefill's chunks
    assert drafted.stats.prefill_seconds < drafted.stats.ttft_seconds  # its own chunks, not the waits


def _long_prefill(smollm2_engine) -> tuple[Engine, list[int]]:
    """An engine with 32-token chunks and a prompt of 20+ chunks: hundreds of scheduled prefill steps."""
    chunked = Engine(smollm2_engine.backend, smollm2_engine.tokenizer, smollm2_engine.eos_token_ids,
                     drafter=smollm2_engine.drafter, exactness=smollm2_engine.exactness, chunk_size=32)
    source = Path(__file__).read_text()[:3000]
    return chunked, chat_ids(chunked.tokenizer, "Summarize the file above.", system=source)


def _wait_for_prefill(turn, steps: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while turn.prefill_passes < steps:
        assert time.monotonic() < deadline, "the prefill did not start"
        time.sleep(0.005)
    return turn.prefill_passes


def test_a_prefill_stops_within_one_step_when_its_client_leaves_or_the_server_closes(smollm2_engine):
    """Codex's first turn went on prefilling for minutes after Codex exited: cancel and close are
    checked between the prefill's layer steps, so neither waits for the rest of the prompt."""
    chunked, long_ids = _long_prefill(smollm2_engine)
    layers = len(chunked.backend.new_cache().layers)
    total_steps = len(chunked.plan(0, len(long_ids) - 1)) * layers
    assert total_steps > 200
    runtime = Runtime(chunked, "m", max_active=2)
    try:
        leaving = runtime.submit(TurnRequest(long_ids, GenerationConfig(max_tokens=8)))
        seen = _wait_for_prefill(leaving, 3)
        leaving.cancel()
        with pytest.raises(TurnCancelled):
            leaving.result(timeout=30)
        assert leaving.prefill_passes <= seen + 1 and leaving.completion is None
        closing = runtime.submit(TurnRequest(long_ids, GenerationConfig(max_tokens=8)))
        seen = _wait_for_prefill(closing, 3)
        started = time.monotonic()
    finally:
        runtime.close()
    assert time.monotonic() - started < 5.0
    with pytest.raises(RuntimeClosed):
        closing.result(timeout=5)
    assert closing.prefill_passes <= seen + 1
