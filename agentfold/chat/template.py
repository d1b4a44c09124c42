"""The one chat renderer: messages (OpenAI chat shape) to prompt text with the model's template.

Every path renders here (HTTP APIs, MCP, the CLI, session cuts, benches), so a prompt and its
cached prefixes are the same text whoever sent them. Templates that know nothing of tools get the
tool section in the system turn; a server-side instruction (`trailing_instruction`: forced tool
choice, JSON output) is its own user turn after the conversation, outside the shared history.

Rendering is prefix-stable: turn N+1's prompt starts with turn N's prompt plus its reply, which
is what lets a session restore turn N's cache. So only the system messages that lead the
conversation are gathered into the system turn; one that comes later (Claude Code sends its
environment that way, after the first user message) stays where it stands, as a system turn
where the template renders one there, else as user text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from agentfold.chat.harmony import is_harmony
from agentfold.chat.tools import ToolSpec, format_tool_call, tool_section

log = logging.getLogger(__name__)


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    return "tools" in template


def trailing_instruction(choice: str | dict[str, Any] | None, fmt: dict[str, Any] | None = None,
                         harmony: bool = False) -> str:
    """The server's instruction for a forced call (`choice`: "required" or `{"name": ...}`) or JSON
    output (`fmt`: a response_format), rendered by `render_chat(trailing=...)`; "" when none applies.
    `harmony`: the model writes calls in its own harmony form (gpt-oss), not as <tool_call> blocks.
    """
    if isinstance(choice, dict):
        if harmony:
            return f"You must now call the function {choice['name']!r}."
        return (f"You must now call the function {choice['name']!r}: answer only with a <tool_call> block "
                "holding its name and JSON arguments.")
    if choice == "required":
        if harmony:
            return "You must now call one of the provided functions."
        return "You must now call one of the provided functions: answer only with <tool_call> blocks."
    if fmt and fmt.get("type") == "json_object":
        return "Answer with a single valid JSON object and nothing else."
    if fmt and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or fmt).get("schema")
        return "Answer with a single valid JSON value matching this JSON schema, and nothing else:\n" + json.dumps(schema)
    return ""


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec | dict] | None = None,
                add_generation_prompt: bool = True, trailing: str | None = None) -> str:
    """The prompt text for `messages` (OpenAI chat shape) with the tokenizer's chat template.

    Messages: `{"role": system|user|assistant|tool, "content": str | None, "tool_calls":
    [{"id", "function": {"name", "arguments"}}], "tool_call_id"}`. Templates that mention tools
    (Qwen, Llama 3.x, ...) get them natively. Others (SmolLM2, Gemma) ignore tools and tool
    messages, so the tools are described in the system prompt, assistant calls are written as
    `<tool_call>` blocks and tool results become `<tool_response>` text in a user turn; same-role
    neighbours are merged so strictly alternating templates accept the result.

    `trailing`: a server-side instruction (forced tool call, JSON output) rendered as its own user
    turn after the conversation, never merged into it, so the conversation's rendering stays a
    prefix of this prompt and the next turn (whose history lacks the instruction) reuses its cache.
    Where a template cannot keep it apart, the instruction is merged into the last user turn.
    """
    if trailing:
        return _render_with_trailing(tokenizer, messages, tools, add_generation_prompt, trailing)
    harmony = is_harmony(tokenizer)
    if harmony:
        messages = [_harmony_message(m) for m in messages]
    else:  # earlier reasoning reaches only a template that reads it (gpt-oss's `message.thinking`)
        messages = [{k: v for k, v in m.items() if k != "thinking"} if "thinking" in m else m for m in messages]
    specs = [t if isinstance(t, ToolSpec) else _spec_from_dict(t) for t in (tools or [])]
    has_tool_traffic = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not getattr(tokenizer, "chat_template", None):
        return _plain_render(_flatten(messages, specs), add_generation_prompt)
    in_place = system_in_place(tokenizer)
    if template_knows_tools(tokenizer) and (specs or has_tool_traffic):
        native = _place_system([_native_message(m) for m in messages], in_place)
        try:
            return tokenizer.apply_chat_template(native, tools=[t.as_openai() for t in specs] or None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as error:  # a template that chokes on tools: fall back to our own section
            if harmony:  # gpt-oss calls only in harmony form: <tool_call> instructions would not be read back
                return tokenizer.apply_chat_template(native, tools=[_string_defaults(t.as_openai()) for t in specs],
                                                     add_generation_prompt=add_generation_prompt, tokenize=False)
            log.info("chat template rejected native tools (%s); describing them in the system prompt", error)
    if specs or has_tool_traffic:
        flat = _flatten(messages, specs, in_place)
    else:
        flat = _merge(_place_system([_simple(m) for m in messages], in_place))
    return tokenizer.apply_chat_template(flat, add_generation_prompt=add_generation_prompt, tokenize=False)


def _string_defaults(value: Any, key: str = "") -> Any:
    """A tool's JSON with each `default` that is not a string written as JSON text.

    gpt-oss's template joins an enum's or a oneOf's default to its text with `+`, which Jinja
    refuses for a number (`"// default: " + 20`); openai-harmony renders that default as its JSON
    (`// default: 20`), which the string gives too. Used only after the template refused the tools.
    """
    if isinstance(value, list):
        return [_string_defaults(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {k: _string_defaults(v, k) for k, v in value.items()}
    if key != "properties" and "default" in value and not isinstance(value["default"], str):
        out["default"] = json.dumps(value["default"], ensure_ascii=False)
    return out


_IN_PLACE: dict[str, bool] = {}  # chat template text -> renders a later system turn where it stands
_MARK = "\u2063agentfold-system\u2063"


def system_in_place(tokenizer) -> bool:
    """Whether the chat template renders a system message that comes after the first user turn in
    place, with the renderings of successive turns each a prefix of the next; probed once per template.

    ChatML (SmolLM2, Qwen) and Llama 3 do; strictly alternating templates (Gemma, Mistral) refuse
    it or drop it, and get its text as a user turn instead (`_place_system`).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return True  # `_plain_render` is ChatML
    key = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    known = _IN_PLACE.get(key)
    if known is None:
        head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "system", "content": _MARK}]
        tail = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        try:
            short = tokenizer.apply_chat_template(head, add_generation_prompt=False, tokenize=False)
            longer = tokenizer.apply_chat_template(head + tail, add_generation_prompt=False, tokenize=False)
            known = _MARK in short and longer.startswith(short)
        except Exception:  # noqa: BLE001  (the template raises on the role order: not in place)
            known = False
        _IN_PLACE[key] = known
    return known


def _place_system(messages: list[dict[str, Any]], in_place: bool) -> list[dict[str, Any]]:
    """Later system messages as user turns where the template cannot render them in place."""
    if in_place:
        return messages
    out, leading = [], True
    for message in messages:
        leading = leading and message["role"] == "system"
        out.append(message if leading or message["role"] != "system" else {**message, "role": "user"})
    return out


_SEPARATOR = "\u2063agentfold-separator\u2063"  # an assistant turn that keeps two user turns apart


def _render_with_trailing(tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec | dict] | None,
                          add_generation_prompt: bool, trailing: str) -> str:
    """The conversation's own rendering, then `trailing` as a user turn of its own.

    The instruction turn's text is cut from a rendering where a placeholder assistant turn keeps
    it apart from the last user turn; it is used only if every rendering involved is a prefix of
    the next (per-message templates: ChatML, Llama, Gemma, ...).
    """
    extra = {"role": "user", "content": trailing}
    spacer = {"role": "assistant", "content": _SEPARATOR}
    try:
        history = render_chat(tokenizer, messages, tools, add_generation_prompt=False)
        head = render_chat(tokenizer, [*messages, spacer], tools, add_generation_prompt=False)
        text = render_chat(tokenizer, [*messages, spacer, extra], tools, add_generation_prompt)
        if head.startswith(history) and text.startswith(head) and _SEPARATOR not in text[len(head):]:
            return history + text[len(head):]
    except Exception as error:  # noqa: BLE001  (a template with its own rules: merge below)
        log.info("chat template cannot render a separate instruction turn (%s); merging it", error)
    return render_chat(tokenizer, [*messages, extra], tools, add_generation_prompt)


def _spec_from_dict(tool: dict[str, Any]) -> ToolSpec:
    function = tool.get("function", tool)
    return ToolSpec(function["name"], function.get("description") or "",
                    function.get("parameters") or {"type": "object", "properties": {}})


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    return str(content)


def _simple(message: dict[str, Any]) -> dict[str, str]:
    role = message.get("role", "user")
    role = "system" if role == "developer" else role
    out = {"role": role, "content": _text(message.get("content"))}
    if role == "assistant" and message.get("thinking"):
        out["thinking"] = message["thinking"]
    return out


def _harmony_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message for the gpt-oss template: its earlier reasoning (`thinking`, from each
    API's reasoning field) is rendered as the analysis message before a tool call, which the
    template allows only alone: with a call, content and thinking both (a preamble and the
    reasoning) keep the thinking."""
    thinking = message.get("thinking")
    if message.get("role") != "assistant" or not isinstance(thinking, str) or not thinking:
        return {k: v for k, v in message.items() if k != "thinking"} if "thinking" in message else message
    if message.get("tool_calls") and _text(message.get("content")).strip():
        return {**message, "content": ""}
    return message


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    out = _simple(message)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {"input": arguments}
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function.get("name", ""), "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _flatten(messages: Sequence[dict[str, Any]], specs: Sequence[ToolSpec],
             in_place: bool = True) -> list[dict[str, str]]:
    """Messages as plain system/user/assistant text, tools described in the system prompt.

    The leading system messages and the tool section make the system turn; a later system
    message stays where it stands (`in_place`) or becomes user text.
    """
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for message in messages:
        role = message.get("role", "user")
        text = _text(message.get("content"))
        if role in ("system", "developer") and not turns:
            if text:
                system.append(text)
        elif role in ("system", "developer"):
            if text:
                turns.append({"role": "system" if in_place else "user", "content": text})
        elif role == "assistant":
            parts = [text.strip()] if text.strip() else []
            for call in message.get("tool_calls") or []:
                function = call.get("function", call)
                parts.append(format_tool_call(function.get("name", ""), function.get("arguments", {})))
            turns.append({"role": "assistant", "content": "\n".join(parts)})
        elif role in ("tool", "function"):
            turns.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            turns.append({"role": "user", "content": text})
    if specs:
        system.append(tool_section(specs))
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + _merge(turns)


def _merge(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    merged: list[dict[str, str]] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] and message["role"] != "assistant":
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n" + message["content"]}
        else:
            merged.append(message)
    return merged


def _plain_render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """A ChatML rendering for tokenizers without a template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
