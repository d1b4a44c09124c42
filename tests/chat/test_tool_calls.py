"""Tool calls in every form models write them, read piece by piece exactly as read at once.

Declared tools make the JSON and Python forms count; a call naming no declared tool, or whose
arguments fail the tool's schema, stays text. Text that cannot become a call streams out at
once; only text that still can is held.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentfold.chat.tool_calls import TextPiece, ToolCallParser, parse_output
from agentfold.chat.tools import ToolCall, ToolSpec

READ = ToolSpec("Read", "Reads a file.", {
    "type": "object", "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["file_path"], "additionalProperties": False})
BASH = ToolSpec("Bash", "Runs a command.", {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
    "required": ["command"]})
READY = ToolSpec("ReadyCheck", "No arguments.", {"type": "object", "properties": {}})
CAFE = ToolSpec("Café", "A name JSON may escape.", {"type": "object", "properties": {}})
TOOLS = [READ, BASH, READY, CAFE]

# Qwen2.5-Coder-1.5B-Instruct's reply (Q4_K_M, greedy) to a Claude Code-style request: the call as
# a fenced JSON block, which the server used to return as the final answer's text.
CODER_FAILURE = ('```json\n{\n  "name": "Read",\n  "arguments": {\n    "file_path": "/work/project/README.md"\n'
                 '  }\n}\n```')
SMOLLM2_FAILURE = ("Here's a JSON with function names and arguments:\n\n```json\n{\n    \"name\": \"Read\",\n"
                   "    \"arguments\": {\n        \"file_path\": \"a.py\"\n    }\n}\n```\n\nThis is the JSON ")

# (reply, content, calls as (name, arguments)) with TOOLS declared
CASES = [
    (CODER_FAILURE, "", [("Read", {"file_path": "/work/project/README.md"})]),
    (SMOLLM2_FAILURE, "Here's a JSON with function names and arguments:", [("Read", {"file_path": "a.py"})]),
    ('<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.py"}}\n</tool_call>', "",
     [("Read", {"file_path": "a.py"})]),
    ('Checking.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "Read", "arguments": {"file_path": "b.py", "limit": 3}}\n</tool_call>', "Checking.",
     [("Bash", {"command": "ls"}), ("Read", {"file_path": "b.py", "limit": 3})]),
    ('{"name": "Read", "arguments": {"file_path": "x.py"}}', "", [("Read", {"file_path": "x.py"})]),
    ('{"name": "Bash", "parameters": {"command": "pwd"}}', "", [("Bash", {"command": "pwd"})]),  # Llama 3.x
    ('<|python_tag|>{"name": "Bash", "parameters": {"command": "pwd"}}', "", [("Bash", {"command": "pwd"})]),
    ('```tool_code\nRead(file_path="g.py", limit=2)\n```', "", [("Read", {"file_path": "g.py", "limit": 2})]),  # Gemma
    ("```tool_code\nBash('echo hi', timeout=1.5)\n```", "", [("Bash", {"command": "echo hi", "timeout": 1.5})]),
    ('Sure.\n```\n{"name": "ReadyCheck", "arguments": {}}\n```', "Sure.", [("ReadyCheck", {})]),
    ('{"name": "Read", "arguments": "{\\"file_path\\": \\"s.py\\"}"}', "", [("Read", {"file_path": "s.py"})]),
    ('{"name": "Caf\\u00e9", "arguments": {}}', "", [("Café", {})]),
    # several calls in one reply
    ('[{"name": "Bash", "arguments": {"command": "ls"}}, {"name": "Read", "arguments": {"file_path": "a.py"}}]', "",
     [("Bash", {"command": "ls"}), ("Read", {"file_path": "a.py"})]),  # a JSON list
    ('Both:\n```json\n[\n  {"name": "Read", "arguments": {"file_path": "a.py"}},\n  {"name": "Read", "arguments": '
     '{"file_path": "b.py"}}\n]\n```', "Both:", [("Read", {"file_path": "a.py"}), ("Read", {"file_path": "b.py"})]),
    ('<tool_call>\n[{"name": "Bash", "arguments": {"command": "ls"}}, {"name": "Bash", "arguments": {"command": "pwd"}}]'
     '\n</tool_call>', "", [("Bash", {"command": "ls"}), ("Bash", {"command": "pwd"})]),  # a list in one tag
    ('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n{"name": "Read", "arguments": {"file_path": "c"}}'
     '\n</tool_call>', "", [("Bash", {"command": "ls"}), ("Read", {"file_path": "c"})]),  # two objects in one tag
    ('```json\n{"name": "Bash", "arguments": {"command": "ls"}}\n```\n```json\n{"name": "Read", "arguments": '
     '{"file_path": "d"}}\n```', "", [("Bash", {"command": "ls"}), ("Read", {"file_path": "d"})]),  # two fences
    ('{"name": "Bash", "parameters": {"command": "ls"}}; {"name": "Bash", "parameters": {"command": "pwd"}}', "",
     [("Bash", {"command": "ls"}), ("Bash", {"command": "pwd"})]),  # Llama 3.x, `;` between calls
    ('[{"name": "Bash", "arguments": {"command": "ls"}}, {"name": "Write", "arguments": {}}]', "",
     [("Bash", {"command": "ls"})]),  # a list of calls: the undeclared one is dropped, not made a call
    # Qwen3-Coder's XML form (its chat template's rendering of a call), values read by the schema's types
    ('<tool_call>\n<function=Read>\n<parameter=file_path>\nnotes.txt\n</parameter>\n<parameter=limit>\n3\n'
     '</parameter>\n</function>\n</tool_call>', "", [("Read", {"file_path": "notes.txt", "limit": 3})]),
    ('Running it.\n<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\necho "done"\n</parameter>\n'
     '<parameter=timeout>\n1.5\n</parameter>\n</function>\n<function=ReadyCheck>\n</function>\n</tool_call>',
     "Running it.", [("Bash", {"command": 'ls -la\necho "done"', "timeout": 1.5}), ("ReadyCheck", {})]),
    ('<tool_call>\n<function=Bash>\n<parameter=command>\n{"a": 1}\n</parameter>\n</function>\n</tool_call>', "",
     [("Bash", {"command": '{"a": 1}'})]),  # a string parameter stays text, JSON-looking or not
    ('<tool_call>\n<function=Read>\n<parameter=file_path>\nz.py\n</parameter>\n</function>', "",
     [("Read", {"file_path": "z.py"})]),  # unterminated at the reply's end, the block complete
    # text, never a call
    ('[{"name": "Write", "arguments": {}}]', '[{"name": "Write", "arguments": {}}]', []),  # names no declared tool
    ("[1, 2, 3] and [{\"id\": 1}]", "[1, 2, 3] and [{\"id\": 1}]", []),
    ('{"name": "Write", "arguments": {"file_path": "a.py"}}', '{"name": "Write", "arguments": {"file_path": "a.py"}}',
     []),  # not a declared tool
    ('{"name": "Read", "arguments": {"path": "a.py"}}', '{"name": "Read", "arguments": {"path": "a.py"}}', []),
    ('{"name": "Read", "arguments": {"file_path": 7}}', '{"name": "Read", "arguments": {"file_path": 7}}', []),
    ('<tool_call>\n{"name": "Nope", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "Nope", "arguments": {}}\n</tool_call>', []),
    ('```tool_code\nRead(path="a.py")\n```', '```tool_code\nRead(path="a.py")\n```', []),
    ('```python\nconfig = {"name": "Read", "arguments": {"file_path": 1}}\n```',
     '```python\nconfig = {"name": "Read", "arguments": {"file_path": 1}}\n```', []),
    ('{"name": "Read", "arguments": {"file_path": "x.py"}, "extra": 1}',
     '{"name": "Read", "arguments": {"file_path": "x.py"}, "extra": 1}', []),
    ('{"name": "Read", "arguments": {"file_path": "cut', '{"name": "Read", "arguments": {"file_path": "cut', []),
    ("Use `{` and ``` freely, and <b>tags</b>; {\"name\": 1}.", "Use `{` and ``` freely, and <b>tags</b>; {\"name\": 1}.",
     []),
    ("text <tool_c", "text <tool_c", []),
    ('<tool_call>\n<function=Write>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>',
     '<tool_call>\n<function=Write>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>', []),  # undeclared
    ('<tool_call>\n<function=Read>\n<parameter=file_path>\na.py\n</parameter>\n<parameter=limit>\nten\n'
     '</parameter>\n</function>\n</tool_call>',
     '<tool_call>\n<function=Read>\n<parameter=file_path>\na.py\n</parameter>\n<parameter=limit>\nten\n'
     '</parameter>\n</function>\n</tool_call>', []),  # an integer parameter that is not one: the schema refuses
    ('<tool_call>\n<function=Read>\n<parameter=file_path>\na.py\n</parameter>\nstray\n</function>\n</tool_call>',
     '<tool_call>\n<function=Read>\n<parameter=file_path>\na.py\n</parameter>\nstray\n</function>\n</tool_call>',
     []),  # anything but parameters inside a function block
]


def _settle(pieces: list) -> tuple[str, list]:
    text = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls = [(c.name, json.loads(c.arguments)) for c in pieces if isinstance(c, ToolCall)]
    return text, calls


def _streamed(reply: str, cuts: list[int], tools=TOOLS) -> tuple[str, list]:
    parser = ToolCallParser(tools=tools)
    pieces, start = [], 0
    for cut in [*sorted(cuts), len(reply)]:
        pieces += parser.feed(reply[start:cut])
        start = max(start, cut)
    pieces += parser.finish()
    settled = _settle(pieces)
    assert settled[0] == parser.content
    return settled


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_each_form_parses_whole_and_at_every_split_point(reply, content, calls):
    whole_content, whole_calls = parse_output(reply, tools=TOOLS)
    assert (whole_content, [(c.name, c.arguments_obj) for c in whole_calls]) == (content, calls)
    for cut in range(len(reply) + 1):
        assert _streamed(reply, [cut]) == (content, calls), cut
    assert _streamed(reply, list(range(len(reply)))) == (content, calls)  # one character at a time


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_equals_the_whole_parse(case, data):
    reply, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(reply)), max_size=12))
    assert _streamed(reply, cuts) == (content, calls)


def test_undeclared_forms_need_declared_tools():
    """Without a declared list only the tagged form is a call (any name); JSON stays text."""
    reply = '{"name": "Read", "arguments": {"file_path": "x.py"}}'
    assert parse_output(reply) == (reply, [])
    content, calls = parse_output('<tool_call>{"name": "anything", "arguments": {"a": 1}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["anything"]
    assert parse_output(CODER_FAILURE, tools_enabled=False, tools=TOOLS) == (CODER_FAILURE, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    reply = '<tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>' \
            '<tool_call>{"name": "Read", "arguments": {"file_path": "a"}}</tool_call>'
    assert [c.name for c in parse_output(reply, tools=TOOLS)[1]] == ["Bash", "Read"]
    assert [c.name for c in parse_output(reply, tools=TOOLS, max_calls=1)[1]] == ["Bash"]
    listed = '[{"name": "Bash", "arguments": {"command": "ls"}}, {"name": "Read", "arguments": {"file_path": "a"}}]'
    assert [c.name for c in parse_output(listed, tools=TOOLS, max_calls=1)[1]] == ["Bash"]


def test_text_before_a_call_streams_out_before_the_call_is_complete():
    parser = ToolCallParser(tools=TOOLS)
    first = parser.feed("Here's a JSON with function names and arguments:\n\n```js")
    assert _settle(first) == ("Here's a JSON with function names and arguments:", [])  # only the fence is held
    assert parser.feed('on\n{\n    "name": "Re') == []
    assert parser.feed('ad",\n    "arguments": {"file_path": "a.py"}') == []
    (call,) = parser.feed("}")
    assert call.name == "Read" and call.arguments_obj == {"file_path": "a.py"}
    assert parser.feed("\n```\n\nThis is the JSON") == [] and parser.finish() == []  # after a call: no text


@pytest.mark.parametrize("chunk", ["```python\nprint('a')\n", "```py", "```bash\nls {x}\n", "x = {'a': 1}\n",
                                   '{"type": "object"}', '{"name": "Writer', "<b>bold</b>", "a < b"])
def test_text_that_cannot_become_a_call_is_not_held(chunk):
    parser = ToolCallParser(tools=TOOLS)
    assert _settle(parser.feed(chunk))[0] == chunk.rstrip()


@pytest.mark.parametrize("chunk", ["```", "```j", "```json\n", "```json\n{", '{"na', '{"name": "Rea', '{"name": "Read",',
                                   "<tool", "<|python", "```tool_code\nRe", '<tool_call>\n{"name": "Bash"'])
def test_text_that_may_still_become_a_call_is_held(chunk):
    parser = ToolCallParser(tools=TOOLS)
    assert parser.feed("Ok. " + chunk) == [TextPiece("Ok.")]
    assert _settle(parser.finish())[0] == " " + chunk  # the reply ended: it was text after all


def test_a_long_call_is_scanned_once():
    """A call that carries a file's worth of text is read in time linear in its length."""
    import time

    body = json.dumps({"name": "Bash", "arguments": {"command": "cat <<'EOF'\n" + "x = {1: [2]}\n" * 4000 + "EOF"}})
    parser = ToolCallParser(tools=TOOLS)
    began = time.perf_counter()
    pieces = [p for start in range(0, len(body), 4) for p in parser.feed(body[start:start + 4])]
    assert time.perf_counter() - began < 5.0  # quadratic rescanning takes minutes here
    assert [c.name for c in pieces if isinstance(c, ToolCall)] == ["Bash"]
