"""gpt-oss's harmony replies read by `chat.harmony` against recorded parses nobody here wrote.

- llama.cpp's gpt-oss cases (tests/test-chat.cpp, saved in tests/fixtures/harmony/): each
  `assert_msg_equals(simple_assist_msg(content, reasoning, name, arguments), common_chat_parse(text,
  ...))` is read out of the C++ source itself, and the reply text must give that reasoning, content
  and call here, whole, at every split point and in any chunking (hypothesis, as
  tests/chat/test_tool_calls.py does).
- openai-harmony's parser cases (tests/test_harmony.py and test-data/, saved there too): the
  reply texts and the `expected` Message lists are read out of the Python source with `ast` and
  compared message by message (role, channel, recipient, content type, text).

Where this server decides otherwise, the test says so: a call whose JSON never completes (llama.cpp's
partial parse returns it as a partial call) is no call here, its text content; with calls turned
off (`tool_choice: none`; llama.cpp's `parse_tool_calls = false` drops the call) a call message's
text is read by its channel, as every other form leaves an unused call as text.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentfold.chat.harmony import (
    HarmonyParser,
    ReasoningPiece,
    harmony_grammar,
    is_harmony,
    parse_harmony,
    reasoning_tokens,
)
from agentfold.chat.tool_calls import TextPiece, parse_output
from agentfold.chat.tools import ToolCall, ToolSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harmony"
CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")


# --- llama.cpp's cases, read from its C++ source ---------------------------------------------------

def _cpp_strings(text: str) -> list[str]:
    """The C++ string literals in `text`, adjacent ones joined (as the compiler joins them)."""
    out: list[str] = []
    end = None
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"', text):
        value = re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), match[1])
        if out and end is not None and not text[end:match.start()].strip():
            out[-1] += value
        else:
            out.append(value)
        end = match.end()
    return out


@dataclass
class LlamaCase:
    text: str
    partial: bool
    content: str
    reasoning: str
    call: tuple[str, str] | None
    reasoning_format: str
    reasoning_in_content: bool
    parse_tool_calls: bool


def llama_cases() -> list[LlamaCase]:
    source = (FIXTURES / "llama.cpp_test-chat_gpt-oss.cpp.txt").read_text(encoding="utf-8")
    cases = []
    for block in re.findall(r"assert_msg_equals\((.*?)\}\)\);", source, re.S):
        expected_src, parse_src = block.split("common_chat_parse(", 1)
        expected = _cpp_strings(expected_src.split("simple_assist_msg(", 1)[1])
        text_src, options = parse_src.split("/* is_partial= */", 1)
        (text,) = _cpp_strings(text_src)
        flag = dict(re.findall(r"/\* \.(\w+) = \*/ (\w+)", options))
        expected += [""] * (4 - len(expected))
        cases.append(LlamaCase(text, options.strip().startswith("true"), expected[0], expected[1],
                               (expected[2], expected[3]) if expected[2] else None,
                               flag["reasoning_format"], flag.get("reasoning_in_content") == "true",
                               flag.get("parse_tool_calls", "true") == "true"))
    return cases


LLAMA = llama_cases()
AUTO = [c for c in LLAMA if c.reasoning_format == "COMMON_REASONING_FORMAT_AUTO" and not c.reasoning_in_content]
SPECIAL = ToolSpec("special_function", "I'm special", {  # llama.cpp's special_function_tool (the fixture)
    "type": "object", "properties": {"arg1": {"type": "integer", "description": "The arg."}}, "required": ["arg1"]})


def test_the_llama_cpp_cases_were_read():
    assert len(LLAMA) == 17 and len(AUTO) == 15
    assert sum(not c.parse_tool_calls for c in AUTO) == 3
    assert AUTO[0].text == "<|channel|>analysis<|message|>I'm\nthink" and AUTO[0].reasoning == "I'm\nthink"


def _settle(pieces: list) -> tuple[str, str, list[tuple[str, Any]]]:
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
    content = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls = [(p.name, p.arguments_obj) for p in pieces if isinstance(p, ToolCall)]
    return reasoning, content, calls


def _streamed(reply: str, cuts: list[int], **options: Any) -> tuple[str, str, list[tuple[str, Any]]]:
    parser = HarmonyParser(**options)
    pieces, last = [], 0
    for cut in sorted(set(cuts)):
        pieces += parser.feed(reply[last:cut])
        last = cut
    pieces += parser.feed(reply[last:])
    pieces += parser.finish()
    for piece in pieces:  # a piece never carries a control token
        if not isinstance(piece, ToolCall):
            assert not any(tag in piece.text for tag in CONTROL), piece
    settled = _settle(pieces)
    assert settled == (parser.reasoning, parser.content, [(c.name, c.arguments_obj) for c in parser.calls])
    return settled


def _expected(case: LlamaCase) -> tuple[str, str, list[tuple[str, Any]]]:
    """What this server returns for a llama.cpp case: llama.cpp's message, except that a call whose
    JSON is incomplete, or any call with calls turned off, is its text (content here)."""
    header, body = case.text.rsplit("<|message|>", 1)
    call_text = body if "to=functions." in header.rsplit("<|start|>", 1)[-1] else ""
    if not case.parse_tool_calls:  # llama.cpp drops the call; here its text is content
        assert case.call is None
        return case.reasoning, case.content + call_text, []
    if case.call is None:
        return case.reasoning, case.content, []
    name, arguments = case.call
    assert arguments == call_text
    try:
        value = json.loads(arguments)
    except ValueError:  # llama.cpp's partial call (`{"arg1`): no call here, the text is content
        return case.reasoning, case.content + arguments, []
    return case.reasoning, case.content, [(name, value)]


def _options(case: LlamaCase) -> dict[str, Any]:
    return {"tools": [SPECIAL], "enabled": case.parse_tool_calls}


@pytest.mark.parametrize("case", AUTO, ids=lambda c: c.text[-40:])
def test_llama_cpp_cases_whole_and_at_every_split_point(case):
    expected = _expected(case)
    whole = parse_harmony(case.text, tools_enabled=case.parse_tool_calls, tools=[SPECIAL])
    assert (whole.reasoning, whole.content, [(c.name, c.arguments_obj) for c in whole.calls]) == expected
    for cut in range(len(case.text) + 1):
        assert _streamed(case.text, [cut], **_options(case)) == expected, cut
    assert _streamed(case.text, list(range(len(case.text))), **_options(case)) == expected


def test_llama_cpp_partial_call_stays_held_while_streaming():
    """llama.cpp's partial parse returns a call still being written; here nothing of a call message
    is streamed before its message ends (then it is a call, or its text)."""
    case = next(c for c in AUTO if c.call and c.call[1] == '{"arg1')
    parser = HarmonyParser(tools=[SPECIAL])
    assert _settle(parser.feed(case.text)) == (case.reasoning, "", [])
    assert _settle(parser.finish()) == ("", '{"arg1', [])


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(AUTO), data=st.data())
def test_llama_cpp_cases_any_chunking_equals_the_whole_parse(case, data):
    cuts = data.draw(st.lists(st.integers(0, len(case.text)), max_size=12))
    assert _streamed(case.text, cuts, **_options(case)) == _expected(case)


# --- openai-harmony's cases, read from its Python tests ---------------------------------------------

class _Role:
    ASSISTANT, USER, SYSTEM, DEVELOPER, TOOL = "assistant", "user", "system", "developer", "tool"


class _Author:
    @staticmethod
    def new(role: str, name: str) -> tuple[str, str]:
        return role, name


class _Message:
    """openai-harmony's Message builder, recording the fields the tests compare."""

    def __init__(self, role: str, text: str, author: str | None = None) -> None:
        self.fields = {"role": role, "channel": None, "recipient": None, "content_type": None, "text": text,
                       "author": author}

    @classmethod
    def from_role_and_content(cls, role: str, text: str) -> _Message:
        return cls(role, text)

    @classmethod
    def from_author_and_content(cls, author: tuple[str, str], text: str) -> _Message:
        return cls(author[0], text, author[1])

    def _with(self, key: str, value: str) -> _Message:
        self.fields[key] = value
        return self

    def with_channel(self, value: str) -> _Message:
        return self._with("channel", value)

    def with_recipient(self, value: str) -> _Message:
        return self._with("recipient", value)

    def with_content_type(self, value: str) -> _Message:
        return self._with("content_type", value)


HARMONY_TESTS = (FIXTURES / "openai-harmony_tests_test_harmony.py.txt").read_text(encoding="utf-8")
PARSE_TESTS = ["test_tool_call_with_constrain_tokenized_correctly", "test_tool_call_with_constrain_marker_adjacent",
               "test_tool_call_with_channel_before_recipient_and_constrain_adjacent",
               "test_streamable_parser_tool_call_with_constrain_adjacent", "test_streamable_parser_missing_message_token",
               "test_streamable_parser_missing_message_token_other_initial_headers",
               "test_streamable_parser_missing_message_token_tool_call"]


def harmony_case(name: str) -> tuple[str, list[dict[str, Any]]]:
    """A parse test's reply text and its expected messages, evaluated from openai-harmony's source."""
    function = next(f for f in ast.parse(HARMONY_TESTS).body if isinstance(f, ast.FunctionDef) and f.name == name)
    found: dict[str, Any] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("text", "expected"):
            scope = {"Message": _Message, "Role": _Role, "Author": _Author}
            found[node.targets[0].id] = eval(compile(ast.Expression(node.value), name, "eval"), scope)  # noqa: S307
    return found["text"], [m.fields for m in found["expected"]]


def _messages(parser: HarmonyParser) -> list[dict[str, Any]]:
    return [{"role": m.role, "channel": m.channel, "recipient": m.recipient, "content_type": m.content_type,
             "text": m.text, "author": m.author} for m in parser.messages]


def _parsed_in_chunks(text: str, cuts: list[int]) -> HarmonyParser:
    parser, last = HarmonyParser(), 0
    for cut in sorted(set(cuts)):
        parser.feed(text[last:cut])
        last = cut
    parser.feed(text[last:])
    parser.finish()
    return parser


@pytest.mark.parametrize("name", PARSE_TESTS)
def test_openai_harmony_parse_cases(name):
    text, expected = harmony_case(name)
    assert _messages(parse_harmony(text)) == expected
    for cut in range(len(text) + 1):
        assert _messages(_parsed_in_chunks(text, [cut])) == expected, cut
    # as the engine gives it: <|call|> / <|return|> end generation and are not in the text
    stripped = text.removesuffix("<|call|>").removesuffix("<|return|>")
    assert stripped != text and _messages(parse_harmony(stripped)) == expected


def test_openai_harmony_cases_as_api_results():
    """The same replies as reasoning, content and calls: the call is one (any `functions.` name with
    no declared list), the message with no channel is content, analysis is reasoning."""
    text, _ = harmony_case("test_tool_call_with_constrain_tokenized_correctly")
    whole = parse_harmony(text)
    assert [(c.name, c.arguments_obj) for c in whole.calls] == [("get_weather", {"location": "Tokyo"})]
    assert (whole.reasoning, whole.content) == ("", "")
    text, _ = harmony_case("test_streamable_parser_missing_message_token")
    whole = parse_harmony(text)
    assert whole.reasoning == "We must refuse"
    assert whole.content == "I must refuse\n\nI'm sorry, but I can't help with that."
    text, _ = harmony_case("test_streamable_parser_missing_message_token_tool_call")
    whole = parse_harmony(text, tools=[ToolSpec("get_weather", "", {"type": "object", "properties": {
        "location": {"type": "string"}}})])
    assert whole.content == "... Let's use the tool." and [c.name for c in whole.calls] == ["get_weather"]


def test_openai_harmony_streamable_parser_file():
    """test-data/test_streamable_parser.txt: openai-harmony finds three messages (its test counts
    them): the analysis, a call to the browser, and the tool's answer (another author)."""
    text = (FIXTURES / "test_streamable_parser.txt").read_text(encoding="utf-8").rstrip()
    parser = parse_harmony(text)
    assert [(m.role, m.channel, m.recipient, m.content_type, m.author) for m in parser.messages] == [
        ("assistant", "analysis", None, None, None),
        ("assistant", "commentary", "browser.search", "code", None),
        ("tool", "commentary", "assistant", None, "browser.search")]
    assert parser.reasoning.startswith('User asks "Who is the current US president?"')
    assert parser.reasoning.endswith("Let's browse to confirm.")
    # browser.search is no declared function: its JSON is not a call; the tool's own message is dropped
    assert parser.calls == [] and parser.content == '{"query": "current US president July 2025", "topn": 10, ' \
                                                    '"source": "news"}'


def test_openai_harmony_tool_response_file():
    """test-data/test_tool_response_parsing.txt: a tool's message (author browser.search, to the
    assistant) is read as such, and is neither reasoning nor content of a reply."""
    text = (FIXTURES / "test_tool_response_parsing.txt").read_text(encoding="utf-8").rstrip()
    parser = parse_harmony(text)
    assert _messages(parser) == [{"role": "tool", "channel": "commentary", "recipient": "assistant",
                                  "content_type": None, "text": '{"result": "https://openai.com/"}',
                                  "author": "browser.search"}]
    assert (parser.reasoning, parser.content, parser.calls) == ("", "", [])


# --- this server's choices -------------------------------------------------------------------------

WEATHER = ToolSpec("get_weather", "Weather of a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False})
REPLY = ("<|channel|>analysis<|message|>The user wants Paris weather. Use get_weather.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}')


def test_reasoning_streams_as_it_comes_and_the_call_when_its_message_ends():
    parser = HarmonyParser(tools=[WEATHER])
    assert parser.feed("<|channel|>analysis<|mess") == []  # a header is held whole
    assert parser.feed("age|>The user wants") == [ReasoningPiece("The user wants")]
    assert parser.feed(" Paris weather.<|e") == [ReasoningPiece(" Paris weather.")]  # "<|e" may be <|end|>
    assert parser.feed("nd|><|start|>assistant<|channel|>commentary<|message|>Check") == [TextPiece("Check")]
    assert parser.feed('ing.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
                       '<|message|>{"city": ') == [TextPiece("ing.")]
    assert parser.feed('"Paris"}') == []
    (call,) = parser.finish()
    assert (call.name, call.arguments_obj) == ("get_weather", {"city": "Paris"})
    assert [type(b).__name__ for b in parser.blocks] == ["ReasoningPiece", "TextPiece", "ToolCall"]


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), [
    # an undeclared name: not a call; its text goes where its channel says
    ('<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{"x": 1}', "", '{"x": 1}', []),
    ('<|channel|>analysis to=python code<|message|>print(1)', "print(1)", "", []),
    # arguments that do not fit the schema, or are not JSON
    ('<|channel|>commentary to=functions.get_weather json<|message|>{"town": "Paris"}', "", '{"town": "Paris"}', []),
    ("<|channel|>commentary to=functions.get_weather json<|message|>Paris", "", "Paris", []),
    # a bare recipient naming a declared tool is a call
    ('<|channel|>commentary to=get_weather json<|message|>{"city": "Rome"}', "", "", [("get_weather", {"city": "Rome"})]),
    # a header cut by max_tokens shows nothing; text without any header is content
    ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.get_wea", "hm", "", []),
    ('{"city": "Paris"}', "", '{"city": "Paris"}', []),
    # a later message without <|end|> (seen in the wild): the <|start|> still opens it
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b", []),
    # after a call, content is dropped; two calls are both returned
    (REPLY + "<|end|><|start|>assistant<|channel|>final<|message|>Done.", "The user wants Paris weather. Use get_weather.",
     "Checking the weather.", [("get_weather", {"city": "Paris"})]),
    (REPLY + '<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
     "The user wants Paris weather. Use get_weather.", "Checking the weather.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    # a hallucinated tool result is neither reasoning nor content
    ("<|channel|>final<|message|>x<|end|><|start|>functions.get_weather to=assistant<|channel|>commentary"
     "<|message|>sunny<|end|>", "", "x", []),
])
def test_what_is_and_is_not_a_call(reply, reasoning, content, calls):
    for cut in range(len(reply) + 1):
        assert _streamed(reply, [cut], tools=[WEATHER]) == (reasoning, content, calls), cut


def test_max_calls_and_calls_turned_off():
    two = REPLY + '<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
    assert [c.arguments_obj["city"] for c in parse_harmony(two, tools=[WEATHER], max_calls=1).calls] == ["Paris"]
    off = parse_harmony(REPLY, tools_enabled=False, tools=[WEATHER])
    assert off.calls == [] and off.content == 'Checking the weather.\n\n{"city": "Paris"}'
    assert parse_output(REPLY, tools=[WEATHER], harmony=True)[0] == "Checking the weather."


def test_harmony_templates_are_recognized():
    class Tokenizer:
        chat_template = (FIXTURES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")

    class ChatML:
        chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

    assert is_harmony(Tokenizer()) and not is_harmony(ChatML())


class _CharTokenizer:
    """One token per character (ids are code points): enough for the Detokenizer's decode calls."""

    def decode(self, ids, skip_special_tokens=True):  # noqa: ARG002
        return "".join(chr(i) for i in ids)


def test_reasoning_tokens_are_the_tokens_that_wrote_the_analysis():
    reply = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>ok"
    parser = parse_harmony(reply)
    assert parser.reasoning == "think"
    tokens = [ord(c) for c in reply] + [0]  # and an end-of-turn token
    assert reasoning_tokens(_CharTokenizer(), tokens, {0}, parser.reasoning_spans) == len("think")
    assert reasoning_tokens(_CharTokenizer(), tokens, {0}, []) == 0


def test_forced_calls_and_json_have_a_harmony_grammar():
    import llguidance

    grammar = harmony_grammar([WEATHER], {"name": "get_weather"}, None, frozenset())
    assert '"commentary to=functions." "get_weather" " "' in grammar
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert llguidance.LLMatcher.validate_grammar(harmony_grammar([], "auto", {"type": "json_object"},
                                                                 frozenset())) == ""
    assert harmony_grammar([WEATHER], "auto", None, frozenset()) is None  # auto: lazy_harmony_grammar (test_harmony_lazy)
