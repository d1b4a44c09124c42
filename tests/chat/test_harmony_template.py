"""gpt-oss's real chat template rendered by `chat.template.render_chat`, against openai-harmony's
recorded renderings (tests/fixtures/harmony/: llama.cpp's copy of the template, harmony's test-data).

The template is rendered the way the server renders every prompt (transformers' Jinja, through
`render_chat`), with a tokenizer that holds only the template: rendering needs no vocabulary.

Where the Hugging Face template and openai-harmony's renderer write the same conversation
differently, the test applies each difference to the recorded text as an explicit edit, named here:

1. `Current date:` is the day of rendering in the template (`strftime_now`), 2025-06-28 in the
   recordings (harmony's tests fix the date).
2. `Reasoning:` is `medium` in the template unless the caller passes `reasoning_effort` (the server
   does not); test_render_functions_with_parameters records `high`.
3. An enum parameter's default: the template writes `// default: celsius,` (its separator comma
   after the comment), harmony `// default: celsius`.
4. A call's content type: the template writes `<|channel|>commentary json`, harmony (given
   `<|constrain|>json`) `<|channel|>commentary <|constrain|>json`.
5. A tool result: the template writes `<|start|>functions.NAME to=assistant<|channel|>commentary
   <|message|>` and the result as a JSON string (`|tojson`: quoted, its quotes escaped); harmony's
   recording, whose tool message has no channel, `<|start|>functions.NAME<|message|>` and the text
   as is.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from agentfold.chat.template import render_chat
from agentfold.chat.tools import ToolSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harmony"
TEMPLATE = (FIXTURES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
HARMONY_TESTS = (FIXTURES / "openai-harmony_tests_test_harmony.py.txt").read_text(encoding="utf-8")


def recorded(name: str) -> str:
    """A rendering from openai-harmony's test-data (its tests strip the trailing newline too)."""
    return (FIXTURES / f"{name}.txt").read_text(encoding="utf-8").rstrip()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                   chat_template=TEMPLATE)


def harmony_tools(test_name: str) -> list[ToolSpec]:
    """The `ToolDescription.new(...)` tools of one openai-harmony test, read from its source."""
    function = next(f for f in ast.parse(HARMONY_TESTS).body if isinstance(f, ast.FunctionDef) and f.name == test_name)
    tools = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "ToolDescription.new":
            name, description = (ast.literal_eval(arg) for arg in node.args)
            keywords = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            tools.append(ToolSpec(name, description, keywords.get("parameters") or {"type": "object", "properties": {}}))
    return tools


def with_recorded_date(text: str) -> str:
    """Edit 1: the template's `Current date:` (today) as the recordings have it."""
    edited, count = re.subn(r"Current date: \d{4}-\d{2}-\d{2}\n", "Current date: 2025-06-28\n", text, count=1)
    assert count == 1
    return edited


def test_system_developer_and_tools_as_harmony_renders_them(tokenizer):
    """test_render_functions_with_parameters: a developer instruction, three function tools (the
    fourth, `kitchensink`, is the next test's), a user message, the generation prompt."""
    tools = [t for t in harmony_tools("test_render_functions_with_parameters") if t.name != "kitchensink"]
    assert [t.name for t in tools] == ["get_location", "get_current_weather", "get_multiple_weathers"]
    messages = [{"role": "system", "content": "Always respond in riddles"},  # harmony: DeveloperContent.with_instructions
                {"role": "user", "content": "What is the weather like in SF?"}]
    rendered = with_recorded_date(render_chat(tokenizer, messages, tools))
    expected = recorded("test_render_functions_with_parameters")
    kitchensink = expected[expected.index("// A function with various complex schemas."):expected.index("} // namespace")]
    expected = (expected.replace(kitchensink, "")  # the tool this test leaves out
                .replace("Reasoning: high", "Reasoning: medium")  # edit 2
                .replace("// default: celsius\n", "// default: celsius,\n"))  # edit 3
    assert rendered == expected


def test_a_tool_the_template_refuses_is_rendered_with_its_defaults_as_text(tokenizer):
    """`kitchensink` (same recording): the template adds a oneOf's default to a string with `+`,
    and Jinja refuses the number 20 (TypeError), which would drop a harmony model's tools to
    <tool_call> instructions it is never read back in. `render_chat` renders such tools again with
    the defaults written as JSON text. The template still renders this schema its own way, unlike
    harmony's recording: no `// params object` or title, no examples, `// default: "the
    default",` with its comma, and the oneOf on one line; the default reads `20` as in harmony's."""
    tools = harmony_tools("test_render_functions_with_parameters")
    with pytest.raises(TypeError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[t.as_openai() for t in tools],
                                      tokenize=False)
    rendered = render_chat(tokenizer, [{"role": "user", "content": "What is the weather like in SF?"}], tools)
    namespace = rendered[rendered.index("## functions"):rendered.index("} // namespace functions")]
    assert "type kitchensink = (_: {\n// A string\nstring?: string," in namespace
    assert "// default: 20," in namespace and "<tool_call>" not in rendered


def test_a_conversation_with_a_call_and_its_result(tokenizer):
    """A system message, tools, a user message, an assistant tool call with its reasoning sent back,
    the tool's result and a second user message, assembled from three recordings:

    - the system message and the developer instruction: test_render_functions_with_parameters
      (edits 1, 2);
    - the developer's tools: test_browser_and_function_tool (its `lookup_weather`);
    - the user message, the analysis, the call and its result: test_does_not_drop_if_ongoing_analysis
      (the analysis stays: no final message follows it; edits 4, 5);
    - the second user message and the generation prompt: test_dropping_cot_by_default.
    """
    (weather,) = harmony_tools("test_browser_and_function_tool")
    arguments, result = '{"location": "San Francisco"}', '{"temperature": 20, "description": "sunny"}'
    reasoning = "User asks: “What is the weather in SF?” We need to use lookup_weather tool."
    messages = [{"role": "system", "content": "Always respond in riddles"},
                {"role": "user", "content": "What is the weather in SF?"},
                {"role": "assistant", "content": "", "thinking": reasoning,
                 "tool_calls": [{"id": "call_1", "function": {"name": "lookup_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
                {"role": "user", "content": "What about 9 / 2?"}]
    rendered = with_recorded_date(render_chat(tokenizer, messages, [weather]))

    functions = recorded("test_render_functions_with_parameters")
    system = functions[:functions.index("<|end|>") + len("<|end|>")].replace("Reasoning: high", "Reasoning: medium")
    instructions = functions[functions.index("<|start|>developer"):functions.index("# Tools")]
    browser = recorded("test_browser_and_function_tool")
    developer_tools = browser[browser.rindex("# Tools"):browser.rindex("<|end|>") + len("<|end|>")]
    ongoing = recorded("test_does_not_drop_if_ongoing_analysis")
    conversation = (ongoing.removesuffix("<|start|>assistant")
                    .replace("<|channel|>commentary <|constrain|>json", "<|channel|>commentary json")  # edit 4
                    .replace(f"<|start|>functions.lookup_weather<|message|>{result}",  # edit 5
                             "<|start|>functions.lookup_weather to=assistant<|channel|>commentary<|message|>"
                             + json.dumps(result)))
    dropping = recorded("test_dropping_cot_by_default")
    second_user = dropping[dropping.rindex("<|start|>user"):]
    assert rendered == system + instructions + developer_tools + conversation + second_user


def test_reasoning_reaches_only_a_harmony_template():
    """`thinking` on an assistant message is the gpt-oss template's; another template (ChatML here)
    renders the same bytes with or without it."""
    chatml = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ m.thinking }}<|im_end|>\n"
                      "{% endfor %}")
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    thought = [plain[0], {**plain[1], "thinking": "greet back"}]
    assert render_chat(chatml, thought) == render_chat(chatml, plain)
