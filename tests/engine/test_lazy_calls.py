"""The lazy tool-call grammar: text stays free, a call once started is held to the tools' schemas,
and drafting stays exact (drafted == serial, token for token, with drafts verified).

On the real SmolLM2-135M engine and on the tokenizer of the coder model (Qwen2.5-Coder-1.5B, whose
`<tool_call>` tags are single special tokens); the coder model itself in the slow suite.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from agentfold.chat.plan import ChatPlan, checked_grammar
from agentfold.chat.template import render_chat
from agentfold.chat.tool_calls import parse_output
from agentfold.chat.tools import ToolSpec
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.lazy_calls import LazyCallConstraint, is_lazy, lazy_tool_grammar, special_tags
from agentfold.engine.sampler import SamplingParams
from tests.helpers.backends import real_model_backend
from tests.helpers.coder import coder_gguf, coder_tokenizer
from tests.helpers.drafting import PinnedDepth

READ = ToolSpec("read_file", "Read a file from disk.",
                {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})
WEATHER = ToolSpec("get_weather", "Get the current weather for a city.",
                   {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOOLS = [READ, WEATHER]
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, seed=3)
needs_coder = pytest.mark.skipif(coder_gguf() is None, reason="the coder model (qwen2.5-coder) is not here")


def shots(call: str, ask: str, files=("README.md", "main.py", "app.py")) -> list[dict]:
    """A conversation where the assistant answered each earlier request with `call % file`."""
    messages = []
    for name in files:
        messages += [{"role": "user", "content": f"Show me {name}"}, {"role": "assistant", "content": call % name}]
    return [*messages, {"role": "user", "content": ask}]


def prompt_and_grammar(tokenizer, messages: list[dict], tools=TOOLS) -> tuple[list[int], str]:
    grammar = checked_grammar(ChatPlan(messages=messages, tools=list(tools)), special_tags(tokenizer))
    assert is_lazy(grammar)
    return tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False), grammar


@pytest.fixture
def engine(smollm2_engine):
    """The session's engine, drafting as deep as allowed for the test (its own controller after)."""
    kept = smollm2_engine.controller
    smollm2_engine.controller = PinnedDepth(max_depth=kept.max_depth)
    try:
        yield smollm2_engine
    finally:
        smollm2_engine.controller = kept


def serial_and_drafted(engine, ids: list[int], grammar: str | None, params=GREEDY, max_tokens: int = 50,
                       held: bool = True):
    """`held`: some drafts must also be accepted (a call the model copies); prose may accept none,
    its rows still chosen in verify passes of several rows."""
    config = GenerationConfig(params=params, max_tokens=max_tokens, grammar=grammar)
    serial = engine.generate(ids, GenerationConfig(params=params, max_tokens=max_tokens, grammar=grammar, draft=False))
    drafted = engine.generate(ids, config)
    assert drafted.tokens == serial.tokens, (drafted.text, serial.text)
    assert drafted.stats.drafted > 0 and (drafted.stats.accepted > 0 or not held)  # drafts were verified
    return drafted


def test_a_started_call_is_forced_to_a_valid_one(engine):
    """The examples call read_file with a parameter its schema lacks (`file`); the model copies it
    unless the grammar holds the started call to the schema."""
    ids, grammar = prompt_and_grammar(engine.tokenizer, shots(
        '<tool_call>\n{"name": "read_file", "arguments": {"file": "%s"}}\n</tool_call>', "Show me setup.py"))
    free = engine.generate(ids, GenerationConfig(max_tokens=50))
    assert '"arguments": {"file": "setup.py"}' in free.text and parse_output(free.text, tools=TOOLS)[1] == []
    for params in (GREEDY, SamplingParams(temperature=0.8, seed=1)):
        reply = serial_and_drafted(engine, ids, grammar, params)
        content, calls = parse_output(reply.text, tools=TOOLS)
        assert reply.text.startswith("<tool_call>") and content == "" and len(calls) == 1, reply.text
        assert calls[0].name == "read_file"
        jsonschema.validate(calls[0].arguments_obj, READ.parameters)
    # the tag alone starts nothing: sampled on, this reply follows its tag with code, and stays text
    reply = serial_and_drafted(engine, ids, grammar, SAMPLED, held=False)
    assert reply.text.startswith('<tool_call>\n"""') and parse_output(reply.text, tools=TOOLS)[1] == [], reply.text


@pytest.mark.parametrize(("form", "ask"), [
    ('```json\n{"name": "read_file", "arguments": {"path": "%s"}}\n```', "Show me setup.py"),
    ('{"name": "read_file", "arguments": {"path": "%s"}}', "Show me setup.py"),
])
def test_fallback_forms_the_model_writes_are_calls(engine, form, ask):
    ids, grammar = prompt_and_grammar(engine.tokenizer, shots(form, ask, ("README.md", "main.py", "app.py", "b.py",
                                                                          "c.py")))
    reply = serial_and_drafted(engine, ids, grammar)
    assert reply.text.startswith(form.split("{")[0] + '{"name": "read_file"'), reply.text
    assert [(c.name, c.arguments_obj) for c in parse_output(reply.text, tools=TOOLS)[1]] == \
        [("read_file", {"path": "setup.py"})]


COPY = ("Repeat this line exactly: the quick brown fox jumps over the lazy dog, "
        "the quick brown fox jumps over the lazy dog.")


@pytest.mark.parametrize(("messages", "params"), [
    (shots('```json\n{"name": "read_file", "arguments": {"path": "%s"}}\n```', "Write a haiku about the sea."), GREEDY),
    ([{"role": "user", "content": "Fix the typo in this function:\n```python\ndef add(a, b):\n    retrun a + b\n```"}],
     GREEDY),
    ([{"role": "user", "content": COPY}], SAMPLED),
])
def test_a_reply_that_never_starts_a_call_is_the_reply_without_the_grammar(engine, messages, params):
    ids, grammar = prompt_and_grammar(engine.tokenizer, messages)
    free = engine.generate(ids, GenerationConfig(params=params, max_tokens=40, draft=False))
    constrained = serial_and_drafted(engine, ids, grammar, params, max_tokens=40, held=False)
    assert constrained.tokens == free.tokens
    assert parse_output(free.text, tools=TOOLS)[1] == []


# --- the mechanism, on the coder model's tokenizer ---------------------------------------------

CODER_TOOLS = [{"name": "Read", "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}},
                                               "required": ["file_path"]}},
               {"name": "Bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                               "required": ["command"]}}]
IM_END, ENDOFTEXT, IM_START = 151645, 151643, 151644


@pytest.fixture(scope="module")
def qwen():
    if coder_gguf() is None:
        pytest.skip("the coder model (qwen2.5-coder) is not here")
    return coder_tokenizer()


def constraint_after(tokenizer, text: str | list[int]) -> LazyCallConstraint:
    grammar = lazy_tool_grammar(CODER_TOOLS, special_tags(tokenizer))
    constraint = LazyCallConstraint(tokenizer, grammar, {IM_END, ENDOFTEXT})
    for token in tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) else text:
        assert constraint._allows(token), (text, token)
        constraint.advance(token)
    return constraint


def pick(constraint: LazyCallConstraint, preferred: list[int], vocab: int = 151936) -> int:
    """The constraint's greedy choice on a row that ranks `preferred` first, in that order."""
    row = np.zeros(vocab, dtype=np.float32)
    for rank, token in enumerate(preferred):
        row[token] = 10.0 - rank
    return constraint.choose(row, 0, GREEDY)


@needs_coder
def test_qwen_call_tags_are_special_tokens_for_llguidance(qwen):
    assert special_tags(qwen) == {"<tool_call>", "</tool_call>"}
    assert qwen.encode("<tool_call>", add_special_tokens=False) == [151657]
    assert not constraint_after(qwen, "Let me look.").in_call
    tag = [*qwen.encode("Let me look.\n", add_special_tokens=False), 151657]
    assert not constraint_after(qwen, tag).in_call  # the tag alone decides nothing: the name does
    assert constraint_after(qwen, [*tag, *qwen.encode('\n{"name": "Read"', add_special_tokens=False)]).in_call
    spelled = [t for piece in ("<", "tool", "_call", ">") for t in qwen.encode(piece, add_special_tokens=False)]
    assert constraint_after(qwen, [*spelled, *qwen.encode('{"name": "Bash"', add_special_tokens=False)]).in_call
    assert constraint_after(qwen, '```json\n{\n  "name": "Read"').in_call
    assert not constraint_after(qwen, 'See:\n```json\n{\n  "name": "Reader"').in_call  # mid-reply: data, not a call
    done = constraint_after(qwen, [151657, *qwen.encode('\n{"name": "Bash", "arguments": {"command": "ls"}}\n',
                                                          add_special_tokens=False), 151658])
    assert not done.in_call and done.live


@needs_coder
def test_free_text_takes_any_token_and_a_call_only_valid_ones(qwen):
    free = constraint_after(qwen, "Sure, here it is")
    assert pick(free, [IM_START]) == IM_START and pick(free, [ENDOFTEXT]) == ENDOFTEXT  # special tokens pass
    word = qwen.encode(" world", add_special_tokens=False)[0]
    assert pick(free, [word]) == word and free.masked_rows == 0
    inside = constraint_after(qwen, '```json\n{\n  "name": "Read",\n  "arguments": {\n    "')
    bad, good = qwen.encode("path", add_special_tokens=False)[0], qwen.encode("file", add_special_tokens=False)[0]
    assert pick(inside, [IM_END, bad, good]) == good and inside.masked_rows == 1  # no end, no undeclared key
    overrun = constraint_after(qwen, 'Then {"name": "Read')  # mid-reply, one token that ends the name and closes the object:
    (closing,) = qwen.encode('"}', add_special_tokens=False)  # the call it starts would have no arguments
    comma = qwen.encode('",', add_special_tokens=False)[0]
    assert not overrun.in_call and pick(overrun, [closing, comma]) == comma
    overrun.advance(comma)
    assert overrun.in_call


@needs_coder
@pytest.mark.parametrize("opening", ['```json\n{\n  "name": "', '{"name": "', '  ```\n{ "name" : "',
                                     [151657, 198, 4913, 606, 788, 330]])  # <tool_call>\n{"name": "
def test_only_a_declared_name_starts_a_call(qwen, opening):
    """Asked what no declared tool answers, the coder model names a tool of its own (a triangle's
    area with only a BMI tool declared: `calculate_area_of_triangle`; Codex's tools: `read_stdin`).
    That object stays text, never a call of a declared tool; a declared name starts a call."""
    if isinstance(opening, list):
        assert qwen.decode(opening) == '<tool_call>\n{"name": "'
    started = constraint_after(qwen, opening)
    assert not started.in_call
    invented, declared = (qwen.encode(word, add_special_tokens=False)[0] for word in ("read", "Bash"))
    assert pick(started, [invented, declared]) == invented and started.masked_rows == 0
    for token in qwen.encode('read_stdin", "arguments": {"path": "notes.txt"}}', add_special_tokens=False):
        assert started._allows(token)  # the invented call is free text to its end
        started.advance(token)
    assert not started.in_call and started.masked_rows == 0
    named = constraint_after(qwen, opening)
    for token in qwen.encode('Bash", "arguments": {"', add_special_tokens=False):
        assert named._allows(token)
        named.advance(token)
    assert named.in_call
    bad, good = qwen.encode("path", add_special_tokens=False)[0], qwen.encode("command", add_special_tokens=False)[0]
    assert pick(named, [bad, good]) == good and named.masked_rows == 1  # the declared tool's schema holds


@needs_coder
def test_a_call_is_free_text_again_once_closed(qwen):
    text = 'A {"name": "Bash", "arguments": {"command": "ls"}} then prose, and <|im_start|> passes.'
    constraint = constraint_after(qwen, text)
    assert constraint.live and not constraint.in_call and constraint.matcher.is_accepting()


@pytest.mark.slow
@needs_coder
def test_coder_model_fenced_call_becomes_a_call_and_stays_exact():
    """The reply that failed with Claude Code: Qwen2.5-Coder writes the call as a fenced JSON block."""
    from agentfold.engine.factory import build_engine

    engine = build_engine(coder_gguf(), backend=real_model_backend())
    engine.controller = PinnedDepth(max_depth=engine.controller.max_depth)
    read = ToolSpec("Read", "Reads a file from the local filesystem.", {
        "type": "object", "properties": {"file_path": {"type": "string", "description": "The absolute path"}},
        "required": ["file_path"], "additionalProperties": False})
    bash = ToolSpec("Bash", "Executes a bash command.", {"type": "object", "properties": {"command": {"type": "string"}},
                                                         "required": ["command"]})
    messages = [{"role": "system", "content": "You are Claude Code, a coding assistant. Use the tools to help the user."},
                {"role": "user", "content": "What is in /work/project/README.md?"}]
    ids, grammar = prompt_and_grammar(engine.tokenizer, messages, [read, bash])
    assert "<tool_call>" in grammar.split("tagged_token:")[1]  # the special-token form
    free = engine.generate(ids, GenerationConfig(max_tokens=48, draft=False))
    reply = serial_and_drafted(engine, ids, grammar, max_tokens=48)
    assert reply.tokens == free.tokens and reply.text.startswith("```json\n{")
    content, calls = parse_output(reply.text, tools=[read, bash])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("Read", {"file_path": "/work/project/README.md"})]
