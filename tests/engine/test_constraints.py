"""Grammar-constrained tool calls: valid JSON from a small model, and drafted == serial under the mask."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from agentfold.engine.constraints import GrammarConstraint, json_object_grammar, tool_call_grammar
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.lazy_calls import special_tags
from agentfold.engine.sampler import SamplingParams
from tests.conftest import chat_ids
from tests.helpers.coder import coder_gguf, coder_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"], "additionalProperties": False}}},
]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def test_named_tool_call_is_valid_and_exact(smollm2_engine):
    ids = chat_ids(smollm2_engine.tokenizer, "What is the weather in Paris?")
    grammar = tool_call_grammar(TOOLS, name="get_weather", parallel=False)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=2)):
        serial = smollm2_engine.generate(ids, GenerationConfig(params=params, max_tokens=40, grammar=grammar,
                                                               draft=False))
        drafted = smollm2_engine.generate(ids, GenerationConfig(params=params, max_tokens=40, grammar=grammar))
        assert drafted.tokens == serial.tokens
        assert serial.finish_reason == "stop", serial.text
        (body,) = CALL.findall(serial.text)
        call = json.loads(body)
        assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


def test_required_tool_call_picks_a_declared_tool(smollm2_engine):
    ids = chat_ids(smollm2_engine.tokenizer, "Show me the contents of setup.py")
    completion = smollm2_engine.generate(ids, GenerationConfig(max_tokens=60, grammar=tool_call_grammar(TOOLS)))
    calls = [json.loads(body) for body in CALL.findall(completion.text)]
    assert calls and all(call["name"] in {"get_weather", "read_file"} for call in calls)


@pytest.mark.skipif(coder_gguf() is None, reason="the coder model (qwen2.5-coder) is not here")
@pytest.mark.parametrize("name", [None, "read_file"])
def test_forced_call_takes_qwens_tag_tokens(name):
    """Qwen2.5's `<tool_call>` is one special token. With the tag spelled as text, llguidance's
    mask let that token through and its matcher then stopped on it: a forced call on the coder
    model was the bare tag. The grammar names the tokens; the spelled tag is still accepted."""
    tokenizer = coder_tokenizer()
    grammar = tool_call_grammar(TOOLS, name=name, parallel=False, special=special_tags(tokenizer))
    body = '\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
    spelled = tokenizer.encode(f"<tool_call>{body}</tool_call>", add_special_tokens=False, split_special_tokens=True)
    as_tokens = [151657, *tokenizer.encode(body, add_special_tokens=False), 151658]
    for tokens in (as_tokens, spelled):
        constraint = GrammarConstraint(tokenizer, grammar)
        for token in tokens:
            assert constraint.allowed(len(tokenizer))[token], tokenizer.decode(tokens)
            constraint.advance(token)
        assert constraint.matcher.is_accepting() and not constraint.matcher.is_error()
    first = np.flatnonzero(GrammarConstraint(tokenizer, grammar).allowed(len(tokenizer)))
    assert 151657 in first and all("<tool_call>".startswith(tokenizer.decode([t])) for t in first)


def test_json_object_mode(smollm2_engine):
    ids = chat_ids(smollm2_engine.tokenizer, "Give me a JSON object describing a cat.")
    completion = smollm2_engine.generate(ids, GenerationConfig(max_tokens=48, grammar=json_object_grammar()))
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert completion.text.lstrip().startswith("{")


def test_arguments_hold_only_declared_parameters():
    """A schema silent on additionalProperties admits only its declared keys (OpenAI strict calls)."""
    import llguidance

    loose = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "range": {"type": "object", "properties": {"start": {"type": "integer"}}}},
        "required": ["path"]}}}
    open_ended = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "additionalProperties": True}}}

    def accepts(tool: dict, body: str) -> bool:
        grammar = tool_call_grammar([tool], name="read_file", parallel=False)
        tokenizer = llguidance.LLTokenizer("byte")
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        ok = all(matcher.consume_token(t) for t in tokenizer.tokenize_str(f"<tool_call>\n{body}\n</tool_call>"))
        return ok and not matcher.is_error()

    assert accepts(loose, '{"name": "read_file", "arguments": {"path": "a.py", "range": {"start": 3}}}')
    assert not accepts(loose, '{"name": "read_file", "arguments": {"path": "a.py", "type": "object"}}')
    assert not accepts(loose, '{"name": "read_file", "arguments": {"path": "a.py", "range": {"end": 3}}}')
    assert accepts(open_ended, '{"name": "read_file", "arguments": {"path": "a.py", "type": "object"}}')
