"""The per-turn log line (a real server, the official openai client) and prefill progress (the real engine)."""

from __future__ import annotations

import logging
import re

import openai
import pytest

from agentfold.engine.decode import GenerationConfig
from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from agentfold.serve.turn_log import PrefillProgress
from tests.conftest import chat_ids
from tests.helpers.api_helpers import MODEL_ID, ServerThread

LOGGER = "agentfold.serve.turn_log"
TURN_LINE = re.compile(r"^turn (?P<api>\w+) session=(?P<session>\S+) prompt=(?P<prompt>\d+) cached=(?P<cached>\d+) "
                       r"head=(?P<head>\d+) reply=(?P<reply>\d+) ttft=(?P<ttft>\d+)ms (?P<tps>\d+\.\d) tok/s "
                       r"drafted=(?P<drafted>\d+) accepted=(?P<accepted>\d+) finish=(?P<finish>\w+)$")
PREFILL_LINE = re.compile(r"^prefill session=(?P<session>\S+) (?P<done>\d+)/(?P<total>\d+) tokens (?P<rate>\d+) tok/s$")


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    service = Service(Runtime(smollm2_engine, MODEL_ID, aliases=("smollm2",)), home=tmp_path_factory.mktemp("home"))
    server = ServerThread(build_app(service)).start()
    yield service, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    server.stop()
    service.close()


def turn_lines(caplog) -> list[re.Match]:
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("turn ")]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == LOGGER)
    matches = [TURN_LINE.match(line) for line in lines]
    assert all(matches), lines  # every turn line has the one greppable shape
    return matches


def test_every_turn_logs_one_line_with_the_responses_figures(served, caplog):
    service, client = served
    caplog.set_level(logging.INFO, logger=LOGGER)
    first = [{"role": "user", "content": "Name three rivers in Europe."}]
    replies = []
    for messages in (first, [*first, {"role": "assistant", "content": "Rhine, Danube, Seine."},
                             {"role": "user", "content": "And one in Africa?"}]):
        replies.append(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                      extra_headers={"X-Session-Id": "s-log"}))
    service.telemetry.flush()
    lines = turn_lines(caplog)
    assert len(lines) == 2
    for line, reply in zip(lines, replies, strict=True):
        block = reply.model_extra["agentfold"]
        assert line["api"] == "chat" and line["session"] == "s-log"
        assert int(line["prompt"]) == reply.usage.prompt_tokens == block["prompt_tokens"]
        assert int(line["cached"]) == block["cached_tokens"]
        assert int(line["reply"]) == reply.usage.completion_tokens
        assert int(line["drafted"]) == block["drafted"] and int(line["accepted"]) == block["accepted"]
        assert abs(int(line["ttft"]) - block["ttft_ms"]) <= 1
        assert line["finish"] == reply.choices[0].finish_reason
    assert int(lines[1]["cached"]) > 0  # the second turn resumed the session


def test_prefill_progress_lines_during_a_chunked_prefill(smollm2_engine, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    prompt = chat_ids(smollm2_engine.tokenizer, "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 12)
    cuts = (16, 48, 80)
    seen: list[int] = []
    progress = PrefillProgress("s-pre", len(prompt), inner=lambda cache: seen.append(cache.length), every_seconds=0.0)
    smollm2_engine.generate(prompt, GenerationConfig(max_tokens=2), cuts=cuts, on_prefill=progress)
    lines = [PREFILL_LINE.match(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert all(lines) and [int(m["done"]) for m in lines] == [c for c in seen if c < len(prompt) - 1]
    assert set(cuts) <= {int(m["done"]) for m in lines}  # the observer it wraps still saw every chunk
    assert all(m["session"] == "s-pre" and int(m["total"]) == len(prompt) and int(m["rate"]) > 0 for m in lines)


def test_no_progress_line_for_a_prefill_shorter_than_the_interval(smollm2_engine, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    prompt = chat_ids(smollm2_engine.tokenizer, "Hello there, how are you?")
    smollm2_engine.generate(prompt, GenerationConfig(max_tokens=2), cuts=(8,),
                            on_prefill=PrefillProgress(None, len(prompt), every_seconds=60.0))
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_the_runtime_logs_a_long_prefill_as_it_goes(smollm2_engine, caplog, monkeypatch):
    """Through the scheduler, as `agentfold serve` runs it: a long prompt's chunks are reported."""
    from agentfold.engine.decode import Engine
    from agentfold.serve import turn_log
    from agentfold.serve.scheduler import Runtime, TurnRequest

    monkeypatch.setattr(turn_log, "PREFILL_LOG_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    chunked = Engine(smollm2_engine.backend, smollm2_engine.tokenizer, smollm2_engine.eos_token_ids,
                     drafter=smollm2_engine.drafter, exactness=smollm2_engine.exactness, chunk_size=32)
    prompt = chat_ids(chunked.tokenizer, "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 12)
    runtime = Runtime(chunked, "m")
    try:
        runtime.submit(TurnRequest(prompt, GenerationConfig(max_tokens=2), session_id="s-run")).result(timeout=120)
    finally:
        runtime.close()
    lines = [PREFILL_LINE.match(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert len(lines) >= len(prompt) // 32 - 1 and all(m["session"] == "s-run" for m in lines)
