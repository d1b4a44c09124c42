"""Qwen3-Coder's real chat template (tests/fixtures/qwen3_coder/: llama.cpp's copy) rendered by
`chat.template.render_chat` and its tool calls parsed back by `chat.tool_calls` (`xml_calls`).

The reference for the rendering is the template itself run by transformers' Jinja on the
conversation in its canonical form (arguments as objects, as the template iterates them): the
server's own message conversion (OpenAI-style JSON argument strings, tool results) must not change
a byte of it. The round trip: each call the template renders into an assistant turn
(`<tool_call><function=NAME><parameter=KEY>value</parameter>...`, every value written as text)
parses back to the same call, its values typed again by the tool's schema (an integer, a string
spanning lines, a boolean and an object, which the template writes as Python's repr).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from agentfold.chat.template import render_chat
from agentfold.chat.tool_calls import parse_output
from agentfold.chat.tools import ToolSpec

TEMPLATE = (Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_coder" / "Qwen3-Coder.jinja").read_text()
TOOLS = [
    ToolSpec("read_lines", "Read lines of a file.",
             {"type": "object", "properties": {"path": {"type": "string", "description": "The file."},
                                               "first": {"type": "integer"}, "count": {"type": "integer"}},
              "required": ["path", "first"]}),
    ToolSpec("write_file", "Write a file.",
             {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                               "options": {"type": "object"},
                                               "overwrite": {"type": "boolean"}},
              "required": ["path", "content"]}),
]
CALLS = [("read_lines", {"path": "src/app.py", "first": 10, "count": 3}),
         ("write_file", {"path": "notes.md", "content": "# Notes\n\nfirst line\n  indented", "options": {"mode": "w"}, "overwrite": True})]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                   chat_template=TEMPLATE)


def conversation(arguments_as_json: bool) -> list[dict]:
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args) if arguments_as_json else args}}
             for i, (name, args) in enumerate(CALLS)]
    return [{"role": "system", "content": "You are a careful coding assistant."},
            {"role": "user", "content": "Show lines 10-12 of src/app.py and start notes.md."},
            {"role": "assistant", "content": "I will read the file and write the notes.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_0", "content": "def main():\n    run()\n"},
            {"role": "tool", "tool_call_id": "call_1", "content": "written"},
            {"role": "user", "content": "Thanks. What does main call?"}]


def test_the_server_renders_what_the_template_renders(tokenizer):
    ours = render_chat(tokenizer, conversation(arguments_as_json=True), TOOLS)
    theirs = tokenizer.apply_chat_template(conversation(arguments_as_json=False),
                                           tools=[t.as_openai() for t in TOOLS], add_generation_prompt=True,
                                           tokenize=False)
    assert ours == theirs
    assert "<function=read_lines>\n<parameter=path>\nsrc/app.py\n</parameter>\n<parameter=first>\n10\n" in ours
    assert ours.endswith("<|im_start|>assistant\n")


def test_calls_the_template_renders_parse_back_to_the_same_calls(tokenizer):
    rendered = render_chat(tokenizer, conversation(arguments_as_json=True), TOOLS)
    turn = rendered.split("<|im_start|>assistant", 1)[1].split("<|im_end|>", 1)[0]
    content, calls = parse_output(turn.lstrip("\n"), tools=TOOLS)
    assert content.strip() == "I will read the file and write the notes."
    assert [(call.name, call.arguments_obj) for call in calls] == CALLS
