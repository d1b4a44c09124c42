"""Tool calls out of the model's text, incrementally: the same parser for streaming and whole replies.

`ToolCallParser.feed` gives content text as soon as it cannot be the start of a `<tool_call>` tag,
and each call once its block closes; `parse_output` is the one-shot form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentfold.chat.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall


@dataclass
class TextPiece:
    """Content text to show the user."""

    text: str


class ToolCallParser:
    """Splits model output into content text and `<tool_call>{json}</tool_call>` calls, incrementally.

    `feed(text)` returns the pieces that are settled: text that cannot be the start of a tag and
    calls whose block closed. Text before the first call is the content; after a call, only
    further calls count (several blocks = parallel calls). A block that does not parse as
    `{"name": str, "arguments": object}` is given back as text. `prefix` is output the prompt
    already forced (e.g. `<tool_call>\\n{"name": "`), parsed as if the model had written it.
    With `enabled=False` everything is text.
    """

    def __init__(self, enabled: bool = True, prefix: str = "") -> None:
        self.enabled = enabled
        self.buffer = ""
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending: list[TextPiece | ToolCall] = []
        self._pending = self.feed(prefix) if prefix else []

    def feed(self, text: str) -> list[TextPiece | ToolCall]:
        out: list[TextPiece | ToolCall] = self._pending
        self._pending = []
        if not self.enabled:
            if text:
                self.content += text
                out.append(TextPiece(text))
            return out
        self.buffer += text
        while True:
            if self.in_call:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                out.extend(self._call_or_text(body))
                continue
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                out.extend(self._text(self.buffer[:start].rstrip()))
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN)
            settled = self.buffer[: len(self.buffer) - keep]
            stripped = settled.rstrip()  # hold trailing whitespace: it may precede a call
            out.extend(self._text(stripped))
            self.buffer = self.buffer[len(stripped):]
            return out

    def finish(self) -> list[TextPiece | ToolCall]:
        """Settle what is left: an unterminated block is a call if its JSON is complete."""
        out = self.feed("")
        if self.in_call:
            self.in_call = False
            body, self.buffer = self.buffer, ""
            out.extend(self._call_or_text(body, unterminated=True))
        elif self.buffer:
            out.extend(self._text(self.buffer))
            self.buffer = ""
        return out

    def _text(self, text: str) -> list[TextPiece]:
        if self.calls:  # after a call, stray text is not content
            return []
        if not self.content:
            text = text.lstrip()
        if not text:
            return []
        self.content += text
        return [TextPiece(text)]

    def _call_or_text(self, body: str, unterminated: bool = False) -> list[TextPiece | ToolCall]:
        call = parse_tool_call(body)
        if call is not None:
            self.calls.append(call)
            return [call]
        raw = TOOL_CALL_OPEN + body + ("" if unterminated else TOOL_CALL_CLOSE)
        return self._text(raw)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_tool_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or `parameters`, or arguments as a JSON string)."""
    text = body.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(text)
    except ValueError:
        value = _first_json_object(text)
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _first_json_object(text: str) -> Any:
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return value


def parse_output(text: str, tools_enabled: bool = True, prefix: str = "") -> tuple[str, list[ToolCall]]:
    """Content and tool calls of a whole reply (the non-streaming form of ToolCallParser)."""
    parser = ToolCallParser(tools_enabled, prefix)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
