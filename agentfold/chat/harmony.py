"""gpt-oss's harmony replies read back: reasoning, content and tool calls, incrementally.

A harmony chat template (gpt-oss; `is_harmony`) ends its prompt with `<|start|>assistant`; the
model then writes one or more messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

The engine renders `<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>` and `<|end|>` as
their text (as llama.cpp does); `<|call|>` and `<|return|>` end the reply and are not in it. The
recipient may come before the channel (`<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>`). A message is read by its header, as openai-harmony's parser reads one:

- `analysis` with no recipient: the chain of thought, returned as reasoning, never as the answer;
- a recipient (`to=functions.NAME`, on the commentary or the analysis channel, as llama.cpp
  accepts both): a tool call whose arguments are the message's JSON text. It is a call only when
  NAME is a declared tool and the text is a JSON object that fits its schema (`call_check`, as for
  every other form; a bare `to=NAME` counts when NAME is declared). Anything else (an undeclared
  name, `to=python` / `to=browser.search`, arguments that are not JSON, a call cut by max_tokens)
  is not made a call: its text is read by its channel, reasoning on analysis, else content, so
  a client never receives a call it cannot run and nothing is lost silently;
- anything else (`final`, `commentary` without a recipient, a message with no channel): content,
  the answer and the preambles shown to the user.

Messages of one kind are joined with a blank line. After the first call, further content is
dropped (as for the other forms: text after a call is not the answer); reasoning is kept. A
message another author wrote (`<|start|>functions.x to=assistant...`, a hallucinated tool
result or user turn) is neither and is dropped. Text that never reaches `<|message|>` (a reply
with no harmony header, such as a JSON object a grammar forced, or `I must refuse<|end|>`) is
read as openai-harmony's lenient parser reads it: a `<|channel|>X` in it names its channel, the
rest is its text (one naming a recipient, `to=...`, is a call cut short and shows nothing). A
body ends at `<|end|>` (or at `<|call|>` / `<|return|>` where they appear in text, and,
leniently, at a `<|start|>` that opens the next message without an `<|end|>`).

`HarmonyParser.feed` gives reasoning and content text as it comes (a piece per fed chunk, never
a control token, holding back only the few characters that may begin one) and each call once its
message has ended; any chunking of a reply gives the same reasoning, content and calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentfold.chat.call_check import DeclaredTools
from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall, ToolSpec

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
ROLES = ("assistant", "user", "system", "developer", "tool")
JOIN = "\n\n"  # between two messages of one kind (two analysis messages, a preamble and the answer)

_HEADER_STOPS = (MESSAGE, END, CALL, RETURN, START)
_BODY_ENDS = (END, CALL, RETURN)  # consumed: they end the message
_BODY_STOPS = (*_BODY_ENDS, START)  # START is not consumed: it opens the next message
_LONGEST = max(len(tag) for tag in _HEADER_STOPS)
_CHANNEL_VALUE = re.compile(r"[^\s<]*")


def is_harmony(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes harmony (`<|start|>` and `<|channel|>`), as
    llama.cpp chooses its gpt-oss format by `<|channel|>` in the template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(value) for value in template.values())
    return isinstance(template, str) and START in template and CHANNEL in template


@dataclass
class ReasoningPiece:
    """Chain-of-thought text (the analysis channel): an API's reasoning, never its answer."""

    text: str


@dataclass
class HarmonyMessage:
    """One message of a reply as its header named it (the fields openai-harmony's `Message` has)."""

    role: str  # assistant | tool | user | system | developer | "" (a role nobody knows)
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str
    author: str | None = None  # a tool message's author name (`functions.get_weather`)
    ended: bool = True  # False: the reply stopped inside it (its end token ends generation, or max_tokens)


@dataclass
class _Header:
    role: str
    author: str | None
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(header: str, role: str | None) -> _Header:
    """A message header (the text between `<|start|>` and `<|message|>`), as openai-harmony's
    `parse_header_from_string` reads it. `role`: the author when the prompt named it (the reply's
    first message, after the prompt's `<|start|>assistant`); None: the header's first word."""
    channel = None
    while (at := header.find(CHANNEL)) != -1:  # every channel marker is cut out; the first one counts
        after = header[at + len(CHANNEL):]
        value = _CHANNEL_VALUE.match(after).group(0)
        channel = channel or value or None
        header = header[:at] + " " + after[len(value):]
    header = header.strip().replace(CONSTRAIN, " " + CONSTRAIN)
    parts = header.split()
    author = None
    if role is None:
        if not parts:
            role = "assistant"
        elif parts[0] in ROLES:
            role = parts[0]
        elif len(parts) > 1 or parts[0].startswith("to="):  # `functions.x to=assistant`: a tool's message
            role, author = "tool", parts.pop(0)
        else:
            role = ""
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:  # what is left before the last two words is ignored (openai-harmony's strict mode refuses it)
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        else:  # a lone word too (openai-harmony takes one for the recipient; a call here needs `to=`)
            content_type = last
            if parts:
                raw = parts.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
    return _Header(role, author, channel, recipient or None, content_type)


def _first(text: str, tags: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """Where the first of `tags` begins in `text` (from `start`), and which (-1, None: none)."""
    best, found = -1, None
    for tag in tags:
        at = text.find(tag, start)
        if at != -1 and (best == -1 or at < best):
            best, found = at, tag
    return best, found


def _partial_tag(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `tags`."""
    for size in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in tags):
            return size
    return 0


class HarmonyParser:
    """A harmony reply as reasoning, content and tool calls, incrementally (the module docstring
    says how each message is read).

    Same contract as `chat.tool_calls.ToolCallParser`: `feed(text)` returns the settled pieces
    (`ReasoningPiece`, `TextPiece`, `ToolCall`), `finish()` the rest; `content`, `reasoning` and
    `calls` hold the whole reply's. `messages` are the messages as their headers named them,
    `blocks` the reply in order (consecutive text of one kind merged), `reasoning_spans` where
    reasoning text stands in the reply (character offsets, to count its tokens).
    `tools`: the declared tools a call must name and fit (None: any `functions.` name);
    `enabled=False`: no calls (a call message is read by its channel); `max_calls`: calls past
    this many are dropped; `prefix`: output the prompt forced, parsed as if the model wrote it.
    """

    def __init__(self, enabled: bool = True, prefix: str = "", tools: Sequence[ToolSpec] | None = None,
                 max_calls: int | None = None) -> None:
        self.enabled = enabled
        self.tools = DeclaredTools(tools)
        self.max_calls = max_calls
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self.messages: list[HarmonyMessage] = []
        self.blocks: list[ReasoningPiece | TextPiece | ToolCall] = []
        self.reasoning_spans: list[tuple[int, int]] = []
        self.buffer = ""
        self._at = -len(prefix)  # reply offset of buffer[0] (the forced prefix is not the reply's)
        self._state = "start"  # start | header | body
        self._seen = 0  # header text already searched for its end
        self._started = False  # the message opened with <|start|> (its header names its role)
        self._header: _Header | None = None
        self._kind = ""  # where the open body goes: reasoning | content | call | drop
        self._body = ""
        self._body_at = 0
        self._joined: set[str] = set()  # kinds the open message has already written text of
        self._pending: list[ReasoningPiece | TextPiece | ToolCall] = []
        self._pending = self.feed(prefix) if prefix else []

    def feed(self, text: str) -> list[ReasoningPiece | TextPiece | ToolCall]:
        out, self._pending = self._pending, []
        self.buffer += text
        self._scan(out, final=False)
        return out

    def finish(self) -> list[ReasoningPiece | TextPiece | ToolCall]:
        """Settle what is left: a header that never reached `<|message|>` is read as text, and the
        message the reply stopped in ends there (a call in it counts if its JSON is complete)."""
        out = self.feed("")
        self._scan(out, final=True)
        return out

    # -- the scan ---------------------------------------------------------------------------------
    def _take(self, size: int) -> None:
        self.buffer = self.buffer[size:]
        self._at += size
        self._seen = 0

    def _scan(self, out: list, final: bool) -> None:
        while True:
            if self._state == "start":
                if self.buffer.startswith(START):
                    self._take(len(START))
                    self._started, self._state = True, "header"
                elif not self.buffer or (not final and START.startswith(self.buffer)):
                    return  # nothing yet, or what may still become <|start|>
                else:
                    self._started, self._state = False, "header"
            elif self._state == "header":
                at, tag = _first(self.buffer, _HEADER_STOPS, self._seen)
                if tag is None:
                    self._seen = max(0, len(self.buffer) - _LONGEST + 1)  # a long headless reply: each part once
                    if final and self.buffer:
                        self._headless(self.buffer, out)
                        self._take(len(self.buffer))
                        self._state = "start"
                    return  # a header is held whole until its <|message|>
                if tag == MESSAGE:
                    self._open(self.buffer[:at])
                    self._take(at + len(MESSAGE))
                    self._state = "body"
                else:  # a message without <|message|>
                    self._headless(self.buffer[:at], out)
                    self._take(at if tag == START else at + len(tag))
                    self._state = "start"
            else:
                at, tag = _first(self.buffer, _BODY_STOPS)
                if tag is None:
                    keep = 0 if final else _partial_tag(self.buffer, _BODY_STOPS)
                    self._body_text(len(self.buffer) - keep, out)
                    if final:
                        self._close(out, ended=False)
                        self._state = "start"
                    return
                self._body_text(at, out)
                self._take(len(tag) if tag in _BODY_ENDS else 0)
                self._close(out, ended=True)
                self._state = "start"

    # -- messages ---------------------------------------------------------------------------------
    def _open(self, header_text: str) -> None:
        header = parse_header(header_text, None if self._started else "assistant")
        self._header, self._body, self._body_at = header, "", self._at + len(header_text) + len(MESSAGE)
        self._joined = set()
        if header.role != "assistant":
            self._kind = "drop"
        elif header.recipient is not None:
            self._kind = "call"
        else:
            self._kind = "reasoning" if header.channel == "analysis" else "content"

    def _body_text(self, size: int, out: list) -> None:
        """The next `size` characters of the buffer are body text: streamed (reasoning, content) or held."""
        if size <= 0:
            return
        text = self.buffer[:size]
        if self._kind in ("reasoning", "content"):
            self._emit(self._kind, text, self._at, out)
        self._body += text
        self._take(size)

    def _close(self, out: list, ended: bool) -> None:
        header = self._header
        assert header is not None
        self.messages.append(HarmonyMessage(header.role, header.channel, header.recipient, header.content_type,
                                            self._body, header.author, ended))
        if self._kind == "call":
            call = self._call(header.recipient or "", self._body)
            if call is not None:
                if self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
                    self.blocks.append(call)
                    out.append(call)
            else:  # not a call a client can run: its text is read by its channel
                kind = "reasoning" if header.channel == "analysis" else "content"
                self._emit(kind, self._body, self._body_at, out)
        self._header, self._kind, self._body = None, "", ""

    def _headless(self, text: str, out: list) -> None:
        """A message that never reached `<|message|>`: read as openai-harmony's lenient parser reads
        one, its channel (if a `<|channel|>` names one) and the rest its text. One whose header names
        a recipient (`to=...`: a call cut before its arguments) has no text to show and is dropped."""
        if not text.strip():
            return
        header = parse_header(text, None if self._started else "assistant")
        body = text
        while (at := body.find(CHANNEL)) != -1:
            value = _CHANNEL_VALUE.match(body, at + len(CHANNEL)).group(0)
            body = body[:at] + body[at + len(CHANNEL) + len(value):]
        words = body.split(None, 1)
        if self._started and words and words[0] == (header.author or header.role):
            body = words[1] if len(words) > 1 else ""
        body = body.strip()
        dropped = header.role != "assistant" or any(word.startswith("to=") for word in body.split())
        self.messages.append(HarmonyMessage(header.role, header.channel, None, None, body, header.author, False))
        if body and not dropped:
            self._joined = set()
            kind = "reasoning" if header.channel == "analysis" else "content"
            self._emit(kind, body, self._at + max(0, text.find(body)), out)

    def _call(self, recipient: str, arguments: str) -> ToolCall | None:
        if not self.enabled:
            return None
        if recipient.startswith("functions."):
            name = recipient[len("functions."):]
        elif not self.tools.any_name and self.tools.declares(recipient):
            name = recipient
        else:
            return None
        return self.tools.call(name, arguments)

    def _emit(self, kind: str, text: str, at: int, out: list) -> None:
        """Reasoning or content text of the open message, from reply offset `at`."""
        if not text or (kind == "content" and self.calls):  # after a call, stray text is not content
            return
        so_far = self.reasoning if kind == "reasoning" else self.content
        piece_text = (JOIN if so_far and kind not in self._joined else "") + text
        self._joined.add(kind)
        if kind == "reasoning":
            self.reasoning += piece_text
            self.reasoning_spans.append((at, at + len(text)))
            piece: ReasoningPiece | TextPiece = ReasoningPiece(piece_text)
        else:
            self.content += piece_text
            piece = TextPiece(piece_text)
        last = self.blocks[-1] if self.blocks else None
        if last is not None and type(last) is type(piece):
            self.blocks[-1] = type(piece)(last.text + piece_text)  # type: ignore[union-attr]
        else:
            self.blocks.append(type(piece)(piece_text))
        out.append(piece)


def parse_harmony(text: str, tools_enabled: bool = True, tools: Sequence[ToolSpec] | None = None,
                  max_calls: int | None = None) -> HarmonyParser:
    """A whole reply parsed (the non-streaming form of HarmonyParser)."""
    parser = HarmonyParser(tools_enabled, "", tools, max_calls)
    parser.feed(text)
    parser.finish()
    return parser


# ---------------------------------------------------------------------------------------------
# Counting reasoning tokens
# ---------------------------------------------------------------------------------------------

def reasoning_tokens(tokenizer: Any, tokens: Sequence[int], eos: set[int] | frozenset[int],
                     spans: Sequence[tuple[int, int]]) -> int:
    """How many of a reply's `tokens` wrote reasoning text (`spans`: HarmonyParser.reasoning_spans).

    The reply is detokenized again exactly as the engine detokenized it, so each token's place in
    the text is known; a token counts when its text overlaps a reasoning span (an end-of-turn
    token writes no text and never counts).
    """
    if not spans:
        return 0
    from agentfold.engine.detokenizer import Detokenizer

    detok, count, begin = Detokenizer(tokenizer), 0, 0
    span_index = 0
    for token in tokens:
        if token in eos:
            continue
        detok.add(int(token))
        end = max(len(detok.text), begin + 1)
        while span_index < len(spans) and spans[span_index][1] <= begin:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] < end and begin < spans[span_index][1]:
            count += 1
        begin = len(detok.text)
    return count


# ---------------------------------------------------------------------------------------------
# Forced calls and JSON output in harmony form
# ---------------------------------------------------------------------------------------------

def special_tags(tokenizer: Any) -> frozenset[str] | None:
    """The harmony tags that are one special token each in `tokenizer` (gpt-oss's: all of them);
    None where llguidance cannot read the tokenizer. A grammar names such a tag as the token."""
    from agentfold.engine.lazy_calls import special_tags as special_of

    return special_of(tokenizer, TAGS)


def _forces_call(tools: Sequence[ToolSpec] | None, choice: Any) -> bool:
    return bool(tools) and (choice == "required" or isinstance(choice, dict))


def _json_output(fmt: dict[str, Any] | None) -> bool:
    return bool(fmt) and fmt.get("type") in ("json_object", "json_schema")


def holds_to_grammar(tools: Sequence[ToolSpec] | None, choice: Any, fmt: dict[str, Any] | None) -> bool:
    """Whether `harmony_grammar` gives a grammar for these (a forced call or JSON output): the caller
    then needs the tokenizer's special tags, whose lookup reads the whole vocabulary once."""
    return _forces_call(tools, choice) or _json_output(fmt)


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RECIPIENT = "to=functions."  # a harmony call's recipient, before the tool's name


def lazy_harmony_grammar(tools: Sequence[ToolSpec], special: frozenset[str]) -> str:
    """The lazy tool-call grammar of a harmony reply (`tool_choice` auto; `engine.lazy_calls`' kind):
    the reply is free (its analysis, preambles, the final answer) until it names a declared tool as
    its recipient and a space, `to=functions.NAME `, as gpt-oss writes a call's header; from there
    the message must be a call, `<|constrain|>json<|message|>` (the markers optional, as llama.cpp
    reads them) and the arguments under that tool's schema. The space is part of the trigger so that
    a longer name the tools do not declare (`NAME_all`) starts nothing: such a call stays free text,
    and the parser returns no call for it. A call whose recipient sits in the role header with no
    space after the name (`to=functions.NAME<|channel|>`: a special token, which free text passes
    unseen) is not held to the grammar and is read from the text as before. Harmony's markers are
    special tokens where `special` says so (gpt-oss's tokenizer: all of them).
    """
    from agentfold.engine.constraints import declared_only, tag_rule
    from agentfold.engine.lazy_calls import LAZY_PRELUDE, regex_literal

    def tag(text: str) -> str:
        return tag_rule(text, special)

    lines = [*LAZY_PRELUDE, f"header: ({tag(CHANNEL)} \"commentary\" \" \"?)? ({tag(CONSTRAIN)}? \"json\")? {tag(MESSAGE)}"]
    calls = []
    for i, tool in enumerate(tools):
        schema = {**declared_only(tool.parameters or {"type": "object"}), "x-guidance": _COMPACT}
        lines += [f"trigger_{i}[lazy]: TEXT /{regex_literal(RECIPIENT + tool.name + ' ')}/",
                  f"args_{i}: %json {json.dumps(schema)}", f"call_{i}: trigger_{i} header args_{i}"]
        calls.append(f"call_{i}")
    lines.append(f"call: {' | '.join(calls)}")
    return "\n".join(lines) + "\n"


def harmony_grammar(tools: Sequence[ToolSpec], choice: str | dict[str, str], fmt: dict[str, Any] | None,
                    special: frozenset[str]) -> str | None:
    """The llguidance grammar of a forced call (`choice` "required" or `{"name": ...}`) or of JSON
    output (`fmt`) in harmony form; None when the reply is free (`tool_choice` auto: harmony calls
    are read from the text, not held to a grammar).

    A forced call is one message, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
    and the arguments under the tool's schema, as gpt-oss writes one; the reply then ends (the
    grammar allows only the end of the reply). JSON output is the final message,
    `<|channel|>final<|message|>` and the value. Both skip the analysis message: a grammar with
    free text before the call is llama.cpp's (a lazy trigger), not this one's.
    """
    from agentfold.engine.constraints import declared_only, tag_rule

    def tag(text: str) -> str:
        return tag_rule(text, special)

    if _forces_call(tools, choice):
        chosen = [t for t in tools if not isinstance(choice, dict) or t.name == choice["name"]]
        lines, names = [], []
        for i, tool in enumerate(chosen):
            schema = {**declared_only(tool.parameters or {"type": "object"}), "x-guidance": _COMPACT}
            lines.append(f"call_{i}: {tag(CHANNEL)} \"commentary to=functions.\" {json.dumps(tool.name)} \" \" "
                         f"{tag(CONSTRAIN)} \"json\" {tag(MESSAGE)} args_{i}")
            lines.append(f"args_{i}: %json {json.dumps(schema)}")
            names.append(f"call_{i}")
        return f"start: {' | '.join(names)}\n" + "\n".join(lines) + "\n"
    if _json_output(fmt):
        schema = {"type": "object"} if fmt["type"] == "json_object" else \
            ((fmt.get("json_schema") or fmt).get("schema") or {"type": "object"})
        return (f"start: {tag(CHANNEL)} \"final\" {tag(MESSAGE)} body\n"
                f"body: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}\n")
    return None
