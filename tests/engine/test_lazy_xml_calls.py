"""Qwen3-Coder's XML calls under `tool_choice` auto: free text until `<function=NAME>` names a
declared tool, then each parameter held to its schema, in the form the model's template writes.

Driven token by token through the engine's `LazyCallConstraint` on a byte-level tokenizer whose
`<tool_call>` tags are special tokens (as Qwen3's are). The reference for what must pass is the
model's own chat template (llama.cpp's copy in tests/fixtures/qwen3_coder/): the assistant turn it
renders for two calls (an integer, a multi-line string, an object and a boolean as Python writes
them) must pass whole; a started call that breaks its schema must be refused where it breaks it.
"""

from __future__ import annotations

import pytest

from agentfold.chat.template import render_chat
from agentfold.chat.tools import ToolSpec
from agentfold.engine.gguf_model import build_tokenizer
from agentfold.engine.lazy_calls import LazyCallConstraint, lazy_tool_grammar, special_tags
from tests.chat.test_qwen3_coder_template import TOOLS, conversation
from tests.chat.test_qwen3_coder_template import tokenizer as template_tokenizer  # noqa: F401  (fixture)
from tests.helpers.gguf_files import tiny_tokenizer_fields

READ = ToolSpec("read_line", "One line of a file.", {
    "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                     "strip": {"type": "boolean"}, "mode": {"type": "string", "enum": ["r", "rb"]}},
    "required": ["path", "line"]})
OPEN = "Reading it.\n<tool_call>\n<function=read_line>\n<parameter=path>\nnotes </para.txt\n</parameter>\n"


@pytest.fixture(scope="module")
def tokenizer():
    fields = tiny_tokenizer_fields()
    tags = ["<tool_call>", "</tool_call>"]
    fields = {**fields, "tokenizer.ggml.tokens": [*fields["tokenizer.ggml.tokens"], *tags],
              "tokenizer.ggml.token_type": [*fields["tokenizer.ggml.token_type"], 3, 3]}
    tokenizer = build_tokenizer(fields, "qwen2")
    assert special_tags(tokenizer) == frozenset(tags)
    return tokenizer


def _first_refused(tokenizer, tools: list[ToolSpec], text: str) -> str | None:
    """The text before the first token the lazy grammar refuses (None: every token passes, and the
    reply is not left inside a call)."""
    grammar = lazy_tool_grammar([{"name": t.name, "parameters": t.parameters} for t in tools], special_tags(tokenizer))
    constraint = LazyCallConstraint(tokenizer, grammar, {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    ids = tokenizer.encode(text, add_special_tokens=False)
    for j, token in enumerate(ids):
        if not constraint._allows(token):
            return tokenizer.decode(ids[:j])
        constraint.advance(token)
    assert not constraint.in_call, text
    return None


def test_the_calls_the_template_writes_pass(tokenizer, template_tokenizer) -> None:  # noqa: F811
    rendered = render_chat(template_tokenizer, conversation(arguments_as_json=True), TOOLS)
    turn = rendered.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    assert turn.count("<function=") == 2 and "<parameter=overwrite>\nTrue\n" in turn
    assert _first_refused(tokenizer, TOOLS, turn) is None


@pytest.mark.parametrize("reply", [
    OPEN + "<parameter=line>\n3\n</parameter>\n</function>\n</tool_call>",
    OPEN + "<parameter=line>\n3\n</parameter>\n<parameter=strip>\nfalse\n</parameter>\n<parameter=mode>\nrb\n"
           "</parameter>\n</function>\n</tool_call>\nDone.",
    "<tool_call>\n<function=read_lines>\n<parameter=first>\nx\n</parameter>\n</function>\n</tool_call>",
    "No call: the file is small.",
], ids=["required only", "every parameter", "undeclared function", "prose"])
def test_what_the_model_may_write_passes(tokenizer, reply: str) -> None:
    assert _first_refused(tokenizer, [READ], reply) is None


@pytest.mark.parametrize("tail, held_at", [
    ("<parameter=line>\nthree", "<parameter=line>\n"),
    ("</function>", "<"),
    ("<parameter=line>\n3\n</parameter>\n<parameter=strip>\nyes", "<parameter=line>\n3\n</parameter>\n"
                                                                  "<parameter=strip>\n"),
    ("<parameter=line>\n3\n</parameter>\n<parameter=mode>\nw\n", "<parameter=line>\n3\n</parameter>\n"
                                                                 "<parameter=mode>\n"),
    ("<parameter=lines>", "<parameter=line"),
], ids=["integer", "missing required", "boolean", "enum", "undeclared parameter"])
def test_a_started_call_is_held_to_its_schema(tokenizer, tail: str, held_at: str) -> None:
    assert _first_refused(tokenizer, [READ], OPEN + tail) == OPEN + held_at
