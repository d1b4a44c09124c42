"""JSON with comments (as Zed, VS Code and opencode write it): parse with positions, merge in place.

A JSON library would drop comments and reformat the user's file; this parser keeps the source
offsets of every value so that only AgentFold's entries are spliced in, and comments, key order,
indentation and trailing commas survive byte for byte.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.integrations.edits import Named, Op, dotted_path, pending_ops, plain_set
from agentfold.integrations.errors import ConfigShapeError, IntegrateError


class JsonSyntaxError(Exception):
    """A JSON-with-comments file that does not parse; the message says where (line and column)."""

    def __init__(self, message: str, text: str, pos: int) -> None:
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        super().__init__(f"line {line} column {column}: {message}")


@dataclass
class JsonNode:
    """A parsed value with its source span `[start, end)`, so it can be replaced in the text."""

    kind: str  # object | array | scalar
    start: int
    end: int = 0
    value: Any = None
    members: list[tuple[str, int, JsonNode]] = field(default_factory=list)  # (key, key start, value) for objects


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class _JsoncParser:
    """JSON plus `//` and `/* */` comments and trailing commas (Zed, VS Code and opencode accept those)."""

    def __init__(self, text: str):
        self.text = text
        self.i = 0

    def fail(self, message: str, pos: int | None = None) -> None:
        raise JsonSyntaxError(message, self.text, self.i if pos is None else pos)

    def skip(self) -> None:
        text, n = self.text, len(self.text)
        while self.i < n:
            c = text[self.i]
            if c in " \t\r\n\ufeff":
                self.i += 1
            elif text.startswith("//", self.i):
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            elif text.startswith("/*", self.i):
                end = text.find("*/", self.i + 2)
                if end < 0:
                    self.fail("unterminated /* comment")
                self.i = end + 2
            else:
                return

    def document(self) -> JsonNode | None:
        self.skip()
        if self.i == len(self.text):
            return None
        node = self.value()
        self.skip()
        if self.i != len(self.text):
            self.fail("unexpected text after the end of the document")
        return node

    def value(self) -> JsonNode:
        if self.i >= len(self.text):
            self.fail("unexpected end of file")
        c = self.text[self.i]
        if c == "{":
            return self.container("object", "}")
        if c == "[":
            return self.container("array", "]")
        start = self.i
        if c == '"':
            return JsonNode("scalar", start, *self.string_end())
        for word, val in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(word, start):
                self.i = start + len(word)
                return JsonNode("scalar", start, self.i, val)
        match = _NUMBER.match(self.text, start)
        if not match:
            self.fail(f"unexpected character {c!r}")
        self.i = match.end()
        return JsonNode("scalar", start, self.i, json.loads(match.group()))

    def string_end(self) -> tuple[int, str]:
        try:
            value, end = json.decoder.scanstring(self.text, self.i + 1, True)
        except json.JSONDecodeError as error:
            self.fail(error.msg, error.pos)
        self.i = end
        return end, value

    def container(self, kind: str, close: str) -> JsonNode:
        node = JsonNode(kind, self.i, value={} if kind == "object" else [])
        self.i += 1
        self.skip()
        while self.i < len(self.text) and self.text[self.i] != close:
            if kind == "object":
                if self.text[self.i] != '"':
                    self.fail("expected a quoted key")
                key_start = self.i
                _, key = self.string_end()
                self.skip()
                if self.i >= len(self.text) or self.text[self.i] != ":":
                    self.fail("expected ':'")
                self.i += 1
                self.skip()
                child = self.value()
                node.members.append((key, key_start, child))
                node.value[key] = child.value
            else:
                child = self.value()
                node.members.append(("", child.start, child))
                node.value.append(child.value)
            self.skip()
            if self.i < len(self.text) and self.text[self.i] == ",":
                self.i += 1
                self.skip()
            elif self.i < len(self.text) and self.text[self.i] != close:
                self.fail(f"expected ',' or '{close}'")
        if self.i >= len(self.text):
            self.fail(f"missing '{close}'", node.start)
        self.i += 1
        node.end = self.i
        return node


def parse_jsonc(text: str) -> JsonNode | None:
    """The document's root node, or None for a file that holds only whitespace and comments."""
    return _JsoncParser(text).document()


def _line_indent(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    return re.match(r"[ \t]*", text[start:]).group()  # type: ignore[union-attr]


def _member(node: JsonNode, key: str) -> JsonNode | None:
    found = [child for k, _, child in node.members if k == key]
    return found[-1] if found else None  # duplicate keys: the last one wins, as in every JSON reader


def _json_set(text: str, root: JsonNode, path: tuple[str, ...], value: Any, unit: str) -> str:
    """`text` with `path` set to `value`, everything else untouched (comments, order, layout)."""
    node = root
    for depth, key in enumerate(path):
        child = _member(node, key)
        if child is None:
            rest: Any = value
            for k in reversed(path[depth + 1:]):
                rest = {k: rest}
            return _json_insert(text, node, key, rest, unit)
        if depth == len(path) - 1:
            rendered = _json_render(value, _line_indent(text, child.start), unit)
            return text[:child.start] + rendered + text[child.end:]
        if child.kind != "object":
            raise ConfigShapeError(".".join(path[: depth + 1]), child.value, "an object")
        node = child
    raise AssertionError("empty path")


def _json_render(value: Any, base: str, unit: str) -> str:
    """`value` as indented JSON whose continuation lines start with `base`; short lists of scalars stay on one line."""
    if isinstance(value, dict) and value:
        inner = base + unit
        members = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_json_render(v, inner, unit)}" for k, v in value.items()]
        return "{\n" + ",\n".join(members) + "\n" + base + "}"
    if isinstance(value, list) and value:
        if not any(isinstance(v, (dict, list)) for v in value):
            flat = "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "]"
            if len(flat) <= 80:
                return flat
        inner = base + unit
        return "[\n" + ",\n".join(inner + _json_render(v, inner, unit) for v in value) + "\n" + base + "]"
    return json.dumps(value, ensure_ascii=False)


def _json_insert(text: str, node: JsonNode, key: str, value: Any, unit: str) -> str:
    close = node.end - 1
    obj_indent = _line_indent(text, node.start)
    if not node.members:
        inner = text[node.start + 1:close]
        member_indent = obj_indent + unit
        member = json.dumps(key, ensure_ascii=False) + ": " + _json_render(value, member_indent, unit)
        if inner.strip() == "":
            return text[:node.start + 1] + "\n" + member_indent + member + "\n" + obj_indent + text[close:]
        return text[:node.start + 1] + "\n" + member_indent + member + text[node.start + 1:]  # comments inside {}
    last = node.members[-1][2]
    first_key_start = node.members[0][1]
    after = _JsoncParser(text)
    after.i = last.end
    after.skip()
    trailing_comma = text[after.i] == ","
    if "\n" not in text[node.start:first_key_start]:  # a one-line object: stay on one line
        member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        return text[:close].rstrip() + ("" if trailing_comma else ",") + " " + member + text[close:]
    member_indent = _line_indent(text, first_key_start)
    member = member_indent + json.dumps(key, ensure_ascii=False) + ": " + _json_render(value, member_indent, unit) + ("," if trailing_comma else "")
    line_start = text.rfind("\n", 0, close) + 1
    if text[line_start:close].strip() == "" and line_start > last.end:
        insert_at, piece = line_start, member + "\n"
    else:
        insert_at, piece = close, "\n" + member + "\n" + obj_indent
    text = text[:insert_at] + piece + text[insert_at:]
    if not trailing_comma:
        text = text[:last.end] + "," + text[last.end:]
    return text


def _indent_unit(text: str, root: JsonNode) -> str:
    if root.members and "\n" in text[root.start:root.members[0][1]]:
        unit = _line_indent(text, root.members[0][1])[len(_line_indent(text, root.start)):]
        if unit:
            return unit
    return "  "


def merge_json(text: str | None, ops: Sequence[Op]) -> str:
    """`text` (None: no file yet) with the pending ops spliced in; unchanged when none is pending."""
    root = parse_jsonc(text) if text is not None else None
    if root is None:
        data: Any = None
        for op in ops:
            data = plain_set(data, op.path, op.value, dotted_path(op.path))
        prefix = text.rstrip() + "\n" if text and text.strip() else ""  # keep a file of only comments
        return prefix + _json_render(data or {}, "", "  ") + "\n"
    if root.kind != "object":
        raise ConfigShapeError("(top level)", root.value, "an object")
    unit = _indent_unit(text, root)  # type: ignore[arg-type]
    expected = copy.deepcopy(root.value)
    for op in pending_ops(root.value, ops):
        if any(isinstance(step, Named) for step in op.path):
            raise AssertionError("JSON targets do not merge lists")
        text = _json_set(text, root, op.path, op.value, unit)  # type: ignore[arg-type]
        expected = plain_set(expected, op.path, op.value, dotted_path(op.path))
        root = parse_jsonc(text)  # type: ignore[assignment,arg-type]
    if root.value != expected:  # the in-place edit must mean exactly the merge
        raise IntegrateError("internal error: the JSON edit did not produce the expected document; nothing written")
    return text  # type: ignore[return-value]
