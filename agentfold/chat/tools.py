"""What the model is told about tools and how it writes a call: the Hermes/Qwen `<tool_call>` form.

`ToolSpec` is a function the client declares, `ToolCall` one the model made; `tool_section` is the
system-prompt block for templates that know nothing of tools, `format_tool_call` an assistant turn's
call written back into history exactly as the model is told to write it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass
class ToolSpec:
    """A function the model may call: name, description and JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolCall:
    """A call parsed out of the model's output; `arguments` is a compact JSON object string."""

    name: str
    arguments: str
    id: str = ""

    @property
    def arguments_obj(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def tool_section(tools: Sequence[ToolSpec]) -> str:
    """The Hermes/Qwen tool instructions, for templates that do not render tools themselves."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def format_tool_call(name: str, arguments: Any) -> str:
    """An assistant tool call written the way the model is told to write one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
