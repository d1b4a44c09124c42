"""Harmony calls under `tool_choice` auto: free text until a declared tool is named, its schema after.

Driven token by token through the engine's `LazyCallConstraint` on a harmony tokenizer (the tiny
gpt-oss vocabulary with harmony's markers as special tokens, built from GGUF metadata as a served
file's is): what gpt-oss writes around a call must pass untouched, a started call must follow the
declared tool's schema, and a name the tools do not declare must start nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentfold.chat.harmony import lazy_harmony_grammar, special_tags
from agentfold.chat.plan import ChatPlan, checked_grammar
from agentfold.chat.tools import ToolSpec
from agentfold.engine.gguf_model import build_tokenizer
from agentfold.engine.lazy_calls import LazyCallConstraint, is_lazy
from agentfold.engine.sampler import SamplingParams
from tests.helpers.gguf_files import harmony_tokenizer_fields

READ_LINE = ToolSpec(name="read_line", description="One line of a file.", parameters={
    "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
    "required": ["path", "line"], "additionalProperties": False})
LS = ToolSpec(name="ls", description="List a folder.", parameters={"type": "object", "properties": {}})
ANALYSIS = "<|channel|>analysis<|message|>The user wants line 3, so read it.<|end|><|start|>assistant"
CALL = "<|channel|>commentary to=functions.read_line <|constrain|>json<|message|>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(harmony_tokenizer_fields(), "gpt-oss")


@pytest.fixture(scope="module")
def grammar(tokenizer) -> str:
    tags = special_tags(tokenizer)
    assert tags is not None and {"<|channel|>", "<|constrain|>", "<|message|>"} <= tags
    return lazy_harmony_grammar([READ_LINE, LS], tags)


def _eos(tokenizer) -> set[int]:
    return {tokenizer.convert_tokens_to_ids("<|return|>"), tokenizer.convert_tokens_to_ids("<|call|>")}


def _first_refused(tokenizer, grammar: str, text: str) -> str | None:
    """The text before the first token the grammar refuses (None: every token passes)."""
    constraint = LazyCallConstraint(tokenizer, grammar, _eos(tokenizer))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for j, token in enumerate(ids):
        if not constraint._allows(token):
            return tokenizer.decode(ids[:j])
        constraint.advance(token)
    return None


@pytest.mark.parametrize("reply", [
    ANALYSIS + CALL + '{"path": "notes.txt", "line": 3}<|call|>',
    ANALYSIS + "<|channel|>commentary to=functions.ls <|constrain|>json<|message|>{}<|call|>",
    ANALYSIS + "<|channel|>final<|message|>Line 3 says hello.<|return|>",
    ANALYSIS + "<|channel|>commentary to=functions.read_lines <|constrain|>json<|message|>{\"all\": 1}<|call|>",
    ANALYSIS + "<|channel|>commentary to=functions.python <|constrain|>json<|message|>print(1)<|call|>",
    ANALYSIS + " to=functions.read_line<|channel|>commentary json<|message|>{\"path\": 7}<|call|>",
], ids=["declared call", "no arguments", "final answer", "longer undeclared name", "undeclared", "role header"])
def test_what_gpt_oss_writes_passes(tokenizer, grammar: str, reply: str) -> None:
    assert _first_refused(tokenizer, grammar, reply) is None


@pytest.mark.parametrize("reply, held_at", [
    (CALL + '{"path": "notes.txt", "line": "3"}', CALL + '{"path": "notes.txt", "line": '),
    (CALL + '{"path": "notes.txt"}<|call|>', CALL + '{"path": "notes.txt"'),
    (CALL + '{"file": "notes.txt"}', CALL + '{"'),
    ("<|channel|>commentary to=functions.read_line <|message|>read it", "<|channel|>commentary to=functions"
     ".read_line <|message|>"),
], ids=["wrong type", "missing required", "undeclared key", "not json"])
def test_a_started_call_is_held_to_its_schema(tokenizer, grammar: str, reply: str, held_at: str) -> None:
    assert _first_refused(tokenizer, grammar, reply) == held_at


def test_a_refused_choice_is_masked_to_the_schema(tokenizer, grammar: str) -> None:
    """A row whose best token breaks the call gets the best token the schema allows instead."""
    constraint = LazyCallConstraint(tokenizer, grammar, _eos(tokenizer))
    for token in tokenizer.encode(CALL + '{"path": "a", "line": ', add_special_tokens=False):
        constraint.advance(token)
    assert constraint.in_call
    quote, three = tokenizer.encode('"', add_special_tokens=False)[0], tokenizer.encode("3", add_special_tokens=False)[0]
    row = np.zeros(len(tokenizer), dtype=np.float32)
    row[quote], row[three] = 9.0, 5.0
    assert constraint.choose(row, 0, SamplingParams()) == three and constraint.masked_rows == 1


def test_auto_tools_on_a_harmony_model_get_the_lazy_grammar(tokenizer) -> None:
    tags = special_tags(tokenizer)
    plan = ChatPlan(messages=[{"role": "user", "content": "line 3 of notes.txt"}], tools=[READ_LINE])
    grammar = checked_grammar(plan, harmony=tags)
    assert grammar is not None and is_lazy(grammar) and "to=functions\\.read_line " in grammar
    plan.tool_choice = "none"
    assert checked_grammar(plan, harmony=tags) is None
