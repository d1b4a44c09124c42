"""Qwen3-Coder's tool calls: `<function=NAME>` blocks of `<parameter=KEY>` values in a `<tool_call>` tag.

Its chat template writes an assistant's call as

    <tool_call>
    <function=Read>
    <parameter=file_path>
    notes.txt
    </parameter>
    </function>
    </tool_call>

a value as text (a string as it is, anything else as JSON), one newline after its opening tag and
one before its closing tag. The parameters become the call's arguments, each read by the type its
tool's schema gives it, as the format's parsers in vLLM and llama.cpp read them: a string (or an
untyped parameter) as its text, any other type parsed as JSON, else as a Python literal (the
template itself writes an earlier call's object or boolean with Jinja's `string` filter: Python's
`{'mode': 'w'}`, `True`; vLLM's parser falls back the same way); a value that parses as neither
stays text, and the schema check then refuses the call. A tag body with anything but such blocks, a
name the request did not declare or arguments that do not fit the schema is no call: the reply
keeps it as text, as with the JSON forms (`call_forms`).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from agentfold.chat.call_check import DeclaredTools
from agentfold.chat.tools import ToolCall

FUNCTION_OPEN = "<function="
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def is_xml_body(body: str) -> bool:
    """Whether a `<tool_call>` tag's body is in this form (its first non-blank text opens a function)."""
    return body.lstrip().startswith(FUNCTION_OPEN)


def xml_calls(body: str, tools: DeclaredTools) -> list[ToolCall]:
    """The calls of a tag body of `<function=...>` blocks, in order; [] when any part is no call."""
    calls = []
    for block in _consecutive(_FUNCTION, body) or ():
        name = block.group(1).strip()
        arguments = _arguments(block.group(2), _properties(tools, name))
        call = tools.call(name, arguments) if arguments is not None else None
        if call is None:
            return []
        calls.append(call)
    return calls


def _arguments(inner: str, properties: dict[str, Any]) -> dict[str, Any] | None:
    """A function block's parameters as arguments; None when it holds anything else."""
    parameters = _consecutive(_PARAMETER, inner)
    if parameters is None:
        return None
    arguments = {}
    for match in parameters:
        key = match.group(1).strip()
        arguments[key] = _value(_unwrapped(match.group(2)), properties.get(key))
    return arguments


def _consecutive(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """`pattern`'s matches one after another from the start of `text` to its end (trailing blanks
    aside); None where anything else lies between or after them."""
    text, at, found = text.rstrip(), 0, []
    while at < len(text):
        match = pattern.match(text, at)
        if match is None:
            return None
        found.append(match)
        at = match.end()
    return found


def _unwrapped(raw: str) -> str:
    """A value without the one newline the template puts after its opening and before its closing tag."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _value(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if None in kinds or "string" in kinds:
        return text
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:  # the template writes a non-string value with Jinja's `string` filter: Python's repr
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _properties(tools: DeclaredTools, name: str) -> dict[str, Any]:
    """The declared tool's argument schemas by name ({} for a tool the request did not declare)."""
    tool = (tools.by_name or {}).get(name)
    properties = (tool.parameters or {}).get("properties") if tool is not None else None
    return properties if isinstance(properties, dict) else {}
