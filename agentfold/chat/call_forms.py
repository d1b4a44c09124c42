"""The forms models write tool calls in, recognized at one position of a reply's text.

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (unterminated at
  the reply's end still counts when its JSON is complete);
- Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`
  (`xml_calls`);
- Llama 3.x: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
- Gemma: a ```tool_code block holding a Python call, `Read(file_path="a.py")`, or JSON;
- what small models fall back to: a JSON object naming a declared tool, with `arguments` or
  `parameters`, bare or in a ```json (or bare ```) fence.

Several calls in one reply: several tags, fences or objects one after another (Llama 3.x puts `;`
between them, which is skipped like any text after a call); a JSON list of call objects, bare, in
a fence or in one tag (`[{"name": ...}, {"name": ...}]`); several objects in one tag. A list whose
first element is a declared tool's call is a list of calls: its elements that name no declared
tool, or whose arguments do not fit, are dropped (never made calls of something else).

`recognize(text, i, ...)` answers for the text from position i: `NO` (no call starts here,
whatever follows), `WAIT` (more text decides) or a `Found` call and where its text ends. An
answer other than WAIT never changes as text is appended, so a reply parsed piece by piece reads
as the whole reply does. The JSON and Python forms count only for declared tools (`DeclaredTools`,
which also checks the arguments against the tool's schema); a JSON object must name the tool
first (`{"name": "Read"`), which is also where the lazy grammar (`engine.lazy_calls`) takes over.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from agentfold.chat.call_check import DeclaredTools
from agentfold.chat.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall
from agentfold.chat.xml_calls import is_xml_body, xml_calls

NO, WAIT = "no", "wait"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```"
FENCE_INFOS = ("", "json", "tool_code")  # ```python and the rest are code, never a call
CALL_KEYS = {"name", "arguments", "parameters"}
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


@dataclass
class Found:
    """The calls (one, or a list's) whose text ends at `end`."""

    calls: list[ToolCall]
    end: int


Answer = str | Found


def recognize(text: str, i: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    """Whether a call starts at `text[i]`. `final`: no more text will come. `memo` carries scans
    of a candidate that waits from one call to the next (the caller clears it when `text` shifts)."""
    char = text[i]
    if char == "<":
        return _tagged(text, i, tools, final, memo)
    if char == "`":
        return _fenced(text, i, tools, final, memo)
    if char == "{" and not tools.any_name:
        return _json_call(text, i, tools, final, memo)
    if char == "[" and not tools.any_name:
        return _json_list(text, i, tools, final, memo)
    return NO


def _starts(text: str, i: int, literal: str, final: bool) -> str | None:
    """None when text[i:] begins with `literal`; WAIT while it is a proper prefix of it; else NO."""
    head = text[i : i + len(literal)]
    if head == literal:
        return None
    return WAIT if literal.startswith(head) and not final else NO


def _tagged(text: str, i: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    tag, python = _starts(text, i, TOOL_CALL_OPEN, final), _starts(text, i, PYTHON_TAG, final)
    if tag is None:
        return _tag_block(text, i + len(TOOL_CALL_OPEN), tools, final, memo)
    if python is None:
        j = _skip_space(text, i + len(PYTHON_TAG))
        if j == len(text):
            return NO if final else WAIT
        if text[j] == "{":
            return _json_call(text, j, tools, final, memo, any_name=True)
        return _python_call(text, j, tools, final, memo)
    return WAIT if WAIT in (tag, python) else NO


def _tag_block(text: str, start: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    """`<tool_call>` ... `</tool_call>` (or the reply's end): the block's JSON as a call, else NO."""
    close = text.find(TOOL_CALL_CLOSE, memo.get(("close", start), start))
    if close < 0 and not final:
        memo[("close", start)] = max(start, len(text) - len(TOOL_CALL_CLOSE) + 1)
        return WAIT
    body, end = (text[start:], len(text)) if close < 0 else (text[start:close], close + len(TOOL_CALL_CLOSE))
    calls = body_calls(body, tools)
    return Found(calls, end) if calls else NO


def body_call(body: str, tools: DeclaredTools) -> ToolCall | None:
    """A tag block's body (`{"name": ..., "arguments": {...}}`, also fenced) as a call."""
    calls = body_calls(body, tools)
    return calls[0] if len(calls) == 1 else None


def body_calls(body: str, tools: DeclaredTools) -> list[ToolCall]:
    """The calls of a tag block's body: one object (also fenced, also with text around it), a list
    of call objects, several objects one after another, or Qwen3-Coder's `<function=...>` blocks
    (`xml_calls`); [] when any of them is no call."""
    if is_xml_body(body):
        return xml_calls(body, tools)
    text = body.strip()
    if text.startswith(FENCE):
        text = text.strip("`").removeprefix("json").strip()
    try:
        values = [json.loads(text)]
    except ValueError:
        values = _json_values(text)
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
        calls = [object_call(value, tools) for value in values]
    else:
        calls = [object_call(value, tools, strict=False) for value in values]
    return calls if calls and all(call is not None for call in calls) else []  # type: ignore[return-value]


def object_call(value: Any, tools: DeclaredTools, strict: bool = True) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": ...}` as a call; `strict`: no other keys."""
    if not isinstance(value, dict) or (strict and not set(value) <= CALL_KEYS):
        return None
    return tools.call(value.get("name"), value.get("arguments", value.get("parameters")))


def _json_values(text: str) -> list[Any]:
    """The JSON objects in `text` from its first `{`, one after another (whitespace, `,` or `;`
    between them); [None] when none parses."""
    start = text.find("{")
    values: list[Any] = []
    decoder = json.JSONDecoder()
    while 0 <= start < len(text):
        try:
            value, start = decoder.raw_decode(text, start)
        except ValueError:
            break
        values.append(value)
        while start < len(text) and (text[start].isspace() or text[start] in ",;"):
            start += 1
        if start < len(text) and text[start] != "{":
            break
    return values or [None]


def _fenced(text: str, i: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    """A fence whose info string is json, tool_code or nothing, holding one call."""
    opened = _starts(text, i, FENCE, final)
    if opened is not None:
        return opened
    newline = text.find("\n", i + len(FENCE))
    info = text[i + len(FENCE) : None if newline < 0 else newline].strip().lower()
    if newline < 0:
        return WAIT if not final and any(name.startswith(info) for name in FENCE_INFOS) else NO
    if info not in FENCE_INFOS:
        return NO
    j = _skip_space(text, newline + 1)
    if j == len(text):
        return NO if final else WAIT
    if info == "tool_code" and text[j] != "{":
        return _python_call(text, j, tools, final, memo)
    if tools.any_name:
        return NO
    if text[j] == "[":
        return _json_list(text, j, tools, final, memo)
    return _json_call(text, j, tools, final, memo) if text[j] == "{" else NO


def _skip_space(text: str, j: int) -> int:
    while j < len(text) and text[j].isspace():
        j += 1
    return j


def _json_call(text: str, j: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any],
               any_name: bool = False) -> Answer:
    """A JSON object at `j` that first names a declared tool (`any_name`: after `<|python_tag|>`,
    where the tag says a call follows, the name may come anywhere in it)."""
    closed = _closed_json(text, j, final, memo) if any_name else _declared_json(text, j, j, tools, final, memo)
    if not isinstance(closed, tuple):
        return closed
    value, end = closed
    call = object_call(value, tools)
    return Found([call], end) if call is not None else NO


def _declared_json(text: str, head_at: int, j: int, tools: DeclaredTools, final: bool,
                   memo: dict[Any, Any]) -> tuple[Any, int] | str:
    """`_closed_json` of the value opening at `j`, where the object at `head_at` first names a
    declared tool; else NO, or WAIT while more text may still name one."""
    head = _head(text, head_at, tools)
    if head != "yes":
        return NO if final else head
    return _closed_json(text, j, final, memo)


def _closed_json(text: str, j: int, final: bool, memo: dict[Any, Any]) -> tuple[Any, int] | str:
    """The JSON value that opens at `j` and where it ends, once its brackets close; else WAIT / NO."""
    end = _closing(text, j, memo, '"')
    if end is None:
        return NO if final else WAIT
    if end < 0:
        return NO
    try:
        return json.loads(text[j:end]), end
    except ValueError:
        return NO


def _json_list(text: str, j: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    """A JSON list at `j` whose first element names a declared tool first: its elements that are
    declared calls whose arguments fit (the rest dropped)."""
    k = _skip_space(text, j + 1)
    if k == len(text):
        return NO if final else WAIT
    if text[k] != "{":
        return NO
    closed = _declared_json(text, k, j, tools, final, memo)
    if not isinstance(closed, tuple):
        return closed
    values, end = closed
    calls = [call for call in (object_call(value, tools) for value in values) if call is not None]
    return Found(calls, end) if calls else NO


def _head(text: str, j: int, tools: DeclaredTools) -> str:
    """"yes" when the object at `j` begins `{"name": "<declared>"`, WAIT while it may, else NO."""
    match = _HEAD.match(text, j)
    if match:
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return NO
        return "yes" if tools.declares(name) else NO
    k = _skip_space(text, j + 1)
    for literal in ('"name"', ":"):
        piece = text[k : k + len(literal)]
        if piece != literal:
            return WAIT if literal.startswith(piece) and k + len(piece) == len(text) else NO
        k = _skip_space(text, k + len(literal))
    if k == len(text):
        return WAIT
    if text[k] != '"':
        return NO
    partial = text[k + 1 :]  # the name so far, as JSON writes it (an escape decides only once closed)
    return WAIT if "\\" in partial or tools.may_name(partial) else NO


class _Closing:
    """Where a bracketed value that opens at `start` closes, scanned as text arrives: brackets and
    strings only (the value is parsed once closed). `end`: None while open, -1 when malformed."""

    PAIRS = {"{": "}", "[": "]", "(": ")"}

    def __init__(self, start: int, quotes: str) -> None:
        self.pos, self.quotes = start, quotes
        self.stack: list[str] = []
        self.quote: str | None = None
        self.escape = False
        self.end: int | None = None

    def run(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            char = text[self.pos]
            self.pos += 1
            if self.quote is not None:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == self.quote:
                    self.quote = None
            elif char in self.quotes:
                self.quote = char
            elif char in self.PAIRS:
                self.stack.append(self.PAIRS[char])
            elif char in "}])":
                if not self.stack or self.stack.pop() != char:
                    self.end = -1
                elif not self.stack:
                    self.end = self.pos
        return self.end


def _closing(text: str, start: int, memo: dict[Any, Any], quotes: str) -> int | None:
    scan = memo.get(("scan", start))
    if scan is None:
        scan = memo[("scan", start)] = _Closing(start, quotes)
    return scan.run(text)


def _python_call(text: str, j: int, tools: DeclaredTools, final: bool, memo: dict[Any, Any]) -> Answer:
    """`name(key=value, ...)` with Python (or JSON) literal values, `name` a declared tool."""
    if tools.any_name:
        return NO
    match = _IDENT.match(text, j)
    if match is None:
        return NO
    name = match.group()
    if match.end() == len(text):
        return WAIT if not final and tools.may_name(name, json_escaped=False) else NO
    if text[match.end()] != "(" or not tools.declares(name):
        return NO
    end = _closing(text, match.end(), memo, "\"'")
    if end is None:
        return NO if final else WAIT
    if end < 0:
        return NO
    call = python_call(text[j:end], tools)
    return Found([call], end) if call is not None else NO


def python_call(source: str, tools: DeclaredTools) -> ToolCall | None:
    """A Python call expression as a tool call: keyword arguments by name, positional ones in the
    order of the tool's declared properties."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or not tools.by_name:
        return None
    spec = tools.by_name.get(node.func.id)
    names = list(((spec.parameters if spec else None) or {}).get("properties") or {})
    try:
        if len(node.args) > len(names) or any(k.arg is None for k in node.keywords):
            return None
        args = {names[n]: _literal(value) for n, value in enumerate(node.args)}
        args.update({k.arg: _literal(k.value) for k in node.keywords if k.arg})
    except ValueError:
        return None
    return tools.call(node.func.id, args)


def _literal(node: ast.AST) -> Any:
    """A JSON value written as a Python literal (JSON's true / false / null read too)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(key is not None for key in node.keys):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = _literal(key)  # type: ignore[arg-type]
            if not isinstance(name, str):
                raise ValueError("a non-string key")
            out[name] = _literal(value)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")
