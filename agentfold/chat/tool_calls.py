"""Tool calls out of the model's text, incrementally: the same parser for streaming and whole replies.

`ToolCallParser.feed` gives content text as soon as it cannot be the start of a call, and each
call once its text is complete; `parse_output` is the one-shot form. The forms a call may take
(tagged, JSON, fenced, Python) are `chat.call_forms`; whether it names a declared tool with
arguments that fit is `chat.call_check`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentfold.chat.call_check import DeclaredTools
from agentfold.chat.call_forms import NO, WAIT, Found, body_call, recognize
from agentfold.chat.tools import ToolCall, ToolSpec

_CANDIDATE = re.compile(r"[<`{\[]")  # where a call can start: a tag, a fence, a JSON object or list


@dataclass
class TextPiece:
    """Content text to show the user."""

    text: str


class ToolCallParser:
    """Splits model output into content text and tool calls, incrementally.

    `feed(text)` returns the pieces that are settled: text that cannot be (part of) a call and
    calls whose text is complete. Text is held only from a point where a call may still start
    (a `<tool_call>` tag or part of one, a ``` fence that may still be json or tool_code, a JSON
    object that may still name a declared tool), and trailing whitespace, which is dropped when a
    call follows. Text before the first call is the content; after a call, only further calls
    count (several = parallel calls). `tools`: the declared tools, which the JSON and Python
    forms must name and every call's arguments must fit; None takes any name, tagged calls only.
    `prefix` is output the prompt already forced, parsed as if the model had written it.
    With `enabled=False` everything is text. `max_calls`: calls past this many are dropped (1 where
    the request set `parallel_tool_calls: false`).
    """

    def __init__(self, enabled: bool = True, prefix: str = "", tools: Sequence[ToolSpec] | None = None,
                 max_calls: int | None = None) -> None:
        self.enabled = enabled
        self.max_calls = max_calls
        self.tools = DeclaredTools(tools)
        self.buffer = ""
        self.calls: list[ToolCall] = []
        self.content = ""
        self._memo: dict[Any, Any] = {}  # scans of the candidate the buffer holds (call_forms.recognize)
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
        self._scan(out, final=False)
        return out

    def finish(self) -> list[TextPiece | ToolCall]:
        """Settle what is left: a candidate that can no longer grow is a call if complete, else text."""
        out = self.feed("")
        if self.enabled:
            self._scan(out, final=True)
            out.extend(self._text(self.buffer))
            self._trim(len(self.buffer))
        return out

    def _scan(self, out: list[TextPiece | ToolCall], final: bool) -> None:
        """Settle the buffer up to the first candidate that must wait (all of it when `final`)."""
        i = 0
        while (match := _CANDIDATE.search(self.buffer, i)) is not None:
            i = match.start()
            answer = recognize(self.buffer, i, self.tools, final, self._memo)
            if answer == NO:
                i += 1
                continue
            settled = self.buffer[:i].rstrip()  # text right before a call loses its trailing space
            out.extend(self._text(settled))
            if answer == WAIT:
                self._trim(len(settled))
                return
            assert isinstance(answer, Found)
            for call in answer.calls:
                if self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
                    out.append(call)
            self._trim(answer.end)
            i = 0
        if not final:
            settled = self.buffer.rstrip()  # hold trailing whitespace: it may precede a call
            out.extend(self._text(settled))
            self._trim(len(settled))

    def _trim(self, size: int) -> None:
        if size:
            self.buffer = self.buffer[size:]
            self._memo.clear()  # its positions were the old buffer's

    def _text(self, text: str) -> list[TextPiece]:
        if self.calls:  # after a call, stray text is not content
            return []
        if not self.content:
            text = text.lstrip()
        if not text:
            return []
        self.content += text
        return [TextPiece(text)]


def parse_tool_call(body: str, tools: Sequence[ToolSpec] | None = None) -> ToolCall | None:
    """A `<tool_call>` block's body, `{"name": ..., "arguments": {...}}` (or `parameters`, or
    arguments as a JSON string), as a call; with `tools`, only a declared one whose arguments fit."""
    return body_call(body, DeclaredTools(tools))


def reply_parser(harmony: bool = False, enabled: bool = True, prefix: str = "",
                 tools: Sequence[ToolSpec] | None = None, max_calls: int | None = None):
    """The parser of a model's replies: `chat.harmony.HarmonyParser` where the chat template is
    harmony (gpt-oss: reasoning, content and calls by channel), else ToolCallParser."""
    if harmony:
        from agentfold.chat.harmony import HarmonyParser

        return HarmonyParser(enabled, prefix, tools, max_calls)
    return ToolCallParser(enabled, prefix, tools, max_calls)


def parse_output(text: str, tools_enabled: bool = True, prefix: str = "",
                 tools: Sequence[ToolSpec] | None = None, max_calls: int | None = None,
                 harmony: bool = False) -> tuple[str, list[ToolCall]]:
    """Content and tool calls of a whole reply (the non-streaming form of the reply's parser;
    `harmony`: a gpt-oss reply, whose reasoning is not content)."""
    parser = reply_parser(harmony, tools_enabled, prefix, tools, max_calls)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
