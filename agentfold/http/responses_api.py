"""OpenAI Responses (`POST /v1/responses`), as Codex CLI speaks it.

Codex sends `input` as an item list (messages, `function_call`, `function_call_output`,
`reasoning`, custom tool calls), `instructions`, a mixed `tools` array (function, freeform
`custom` such as apply_patch, hosted tools) and nothing about sampling. Unknown tool types are
dropped, never refused; `custom` tools are offered to the model as a function taking one string
`input` and come back as `custom_tool_call` items. The stream always ends with
`response.completed` (status `incomplete` when the token budget ran out), because Codex treats a
stream without it as broken. Codex itself resends the whole conversation with `store: false`;
other clients send only the new items with `previous_response_id`, which is served from the
responses this server kept (`response_store`), and refused as unknown once that one is gone,
never answered from a partial conversation. The model reads text only: an image is a 400.

A harmony model's (gpt-oss's) analysis text is a `reasoning` item (`content`: one `reasoning_text`,
`summary` empty) before the message and call items, in the order written, streamed as
`response.output_item.added`, `response.content_part.added`, `response.reasoning_text.delta`,
`response.reasoning_text.done`, `response.content_part.done`, `response.output_item.done`. A
`reasoning` item in the input (its `reasoning_text`, else its summary) becomes the `thinking` of
the assistant message or call that follows it, which the gpt-oss template renders before a call.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentfold.chat.plan import ChatPlan, ContextOverflow, check_schema, parse_tool_choice
from agentfold.chat.tools import ToolSpec
from agentfold.http.errors import ApiError
from agentfold.http.fields import get_bool, get_int, get_str
from agentfold.http.openai_api import common_fields, content_text, parse_response_format
from agentfold.http.response_store import MAX_RESPONSES, ResponseStore
from agentfold.http.responses_stream import ResponseShape, overflow_events, response_events
from agentfold.http.stream import SSE_HEADERS, collect, prepare
from agentfold.sessions.ids import session_id_for_key

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
SKIPPED_ITEMS = ("reasoning", "item_reference", "web_search_call", "file_search_call", "computer_call",
                 "computer_call_output", "image_generation_call", "code_interpreter_call", "local_shell_call",
                 "local_shell_call_output", "mcp_call", "mcp_list_tools", "compaction")


NON_TEXT_PARTS = ("input_image", "image_url", "image", "input_audio", "input_file", "file")


def _check_text_only(parts: Any, where: str) -> None:
    """A 400 for an image, audio or file part: dropping it would answer a question the model never saw."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NON_TEXT_PARTS:
            raise ApiError(f"'{where}[{j}]' is a part of type {kind!r}, but the served model is text-only; "
                           "send text (for a file, its contents as input_text).", param="input",
                           code="unsupported_content")


def input_items(value: Any) -> list[dict[str, Any]]:
    """`input` as an item list (a string is one user message), as kept for `previous_response_id`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}] if value else []
    if not isinstance(value, list):
        raise ApiError("'input' must be a string or an array of input items.", param="input")
    return value


def _output_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return content_text(value, where)
    if value is None:
        return ""
    raise ApiError(f"'{where}' must be a string or an array of content parts.", param="input")


def parse_input(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` + `input` (a string or an item list) as chat messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if value is None:
        return messages
    if isinstance(value, str):
        if value:
            messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list):
        raise ApiError("'input' must be a string or an array of input items.", param="input")
    thinking = ""  # reasoning items' text, for the assistant message or call that follows them
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"'{where}' must be an object.", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        _check_text_only(item.get("content"), f"{where}.content")
        _check_text_only(item.get("output"), f"{where}.output")
        if kind == "reasoning":
            text = reasoning_text(item)
            thinking = f"{thinking}\n\n{text}" if thinking and text else (thinking or text)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise ApiError(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}.",
                               param="input")
            messages.append({"role": role, "content": content_text(item.get("content"), f"{where}.content")})
            if role == "assistant" and thinking:
                messages[-1]["thinking"] = thinking  # the template's `thinking` (gpt-oss's analysis)
            thinking = ""
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(f"'{where}.name' must be a non-empty string.", param="input")
            if kind == "function_call":
                arguments = item.get("arguments", "{}")
                if not isinstance(arguments, str):
                    raise ApiError(f"'{where}.arguments' must be a JSON string.", param="input")
            else:
                arguments = {"input": _output_text(item.get("input"), f"{where}.input")}
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thinking:
                messages[-1]["thinking"] = "\n\n".join(t for t in (messages[-1].get("thinking"), thinking) if t)
            thinking = ""
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                             "content": _output_text(item.get("output"), f"{where}.output")})
            thinking = ""
        elif kind in SKIPPED_ITEMS or kind is None or isinstance(kind, str):
            continue  # reasoning and hosted-tool items: nothing this model can use
    return messages


def reasoning_text(item: dict[str, Any]) -> str:
    """A `reasoning` input item's text: its `reasoning_text` content, else its summary's text."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and p.get("type", kind) == kind
                     and isinstance(p.get("text"), str) and p["text"]]
            if texts:
                return "\n\n".join(texts)
    return ""


def parse_tools(value: Any) -> tuple[list[ToolSpec], set[str]]:
    """Function and custom tools (custom ones named in the second value); other types dropped."""
    if value is None:
        return [], set()
    if not isinstance(value, list):
        raise ApiError("'tools' must be an array of tools.", param="tools")
    tools, custom = [], set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ApiError(f"'tools[{i}]' must be an object.", param="tools")
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(f"'tools[{i}]' needs a non-empty 'name'.", param="tools")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(f"'tools[{i}].description' must be a string.", param="tools")
        if kind == "function":
            tools.append(ToolSpec(name, description, check_schema(tool.get("parameters"), f"'tools[{i}].parameters'")))
        else:
            fmt = tool.get("format") or {}
            hint = "Free-form text input."
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                hint = f"Text in this {fmt.get('syntax', 'grammar')} grammar:\n{fmt.get('definition', '')}"
            tools.append(ToolSpec(name, description, {
                "type": "object", "properties": {"input": {"type": "string", "description": hint}},
                "required": ["input"]}))
            custom.add(name)
    return tools, custom


def _tool_choice(value: Any, tools: list[ToolSpec]) -> str | dict[str, str]:
    if isinstance(value, dict) and value.get("type") not in ("function", "custom", "auto", "none", "required",
                                                               "any", "tool"):
        return "auto"  # allowed_tools, hosted tools: let the model choose among what it has
    return parse_tool_choice(value, tools)


def responses_plan(body: dict[str, Any], request: Request, items: list[dict[str, Any]] | None = None,
                   session_id: str | None = None) -> tuple[ChatPlan, set[str]]:
    """The request as a chat plan, and the names of its custom (free-form) tools.

    `items`: the whole conversation (a previous response's, then this input); default this input.
    `session_id`: the previous response's session, used when the request names none.
    """
    instructions = get_str(body, "instructions")
    tools, custom = parse_tools(body.get("tools"))
    conversation = items if items is not None else body.get("input")
    plan = ChatPlan(messages=parse_input(conversation, instructions), tools=tools)
    common_fields(plan, body, request)
    plan.tool_choice = _tool_choice(body.get("tool_choice"), tools)
    plan.parallel_tool_calls = get_bool(body, "parallel_tool_calls", True)
    text_options = body.get("text")
    if text_options is not None and not isinstance(text_options, dict):
        raise ApiError("'text' must be an object.", param="text")
    plan.response_format = parse_response_format((text_options or {}).get("format"), "text.format")
    plan.max_tokens = get_int(body, "max_output_tokens", minimum=1)
    plan.max_tokens_param = "max_output_tokens"
    cache_key = get_str(body, "prompt_cache_key")
    plan.session_id = plan.session_id or (session_id_for_key(cache_key) if cache_key else None) or session_id
    if not plan.messages:
        plan.messages = [{"role": "user", "content": ""}]  # Codex probes with empty input
    return plan, custom


_STORES: weakref.WeakKeyDictionary[Any, ResponseStore] = weakref.WeakKeyDictionary()


def response_store(server: Any) -> ResponseStore:
    """The responses one server keeps (one store per server object, gone with it)."""
    store = _STORES.get(server)
    if store is None:
        store = _STORES[server] = ResponseStore()
    return store


def _previous(server: Any, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """`previous_response_id`, the conversation it ends, and its session; a 400 when it is not held."""
    previous_id = get_str(body, "previous_response_id")
    if not previous_id:
        return None, [], None
    found = response_store(server).conversation(previous_id)
    if found is None:
        raise ApiError(f"Previous response with id '{previous_id}' not found. This server keeps responses in "
                       f"memory (those created with store: true, the latest {MAX_RESPONSES} at most), so it has been "
                       "evicted, was created with store: false, or the server restarted; send the whole "
                       "conversation in 'input' instead.", param="previous_response_id",
                       code="previous_response_not_found")
    return previous_id, found[0], found[1]


async def responses(server: Any, request: Request, body: dict[str, Any]) -> Response:
    """`POST /v1/responses`: one JSON response, or its event stream ending in `response.completed`."""
    previous_id, history, session_id = _previous(server, body)
    new_items = input_items(body.get("input"))
    plan, custom = responses_plan(body, request, [*history, *new_items], session_id)
    store = response_store(server) if get_bool(body, "store", True) else None
    shape = ResponseShape(body, plan, custom, plan.model or server.runtime.model_id, get_str(body, "instructions"),
                          previous_id, store, new_items)
    try:
        prepared = prepare(server.runtime, plan, "responses", request, server.default_max_tokens)
    except ContextOverflow as error:
        overflow = ApiError(error.message, code=error.code, param="input")
        if not plan.stream:
            raise overflow from error
        return StreamingResponse(overflow_events(shape, overflow), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not plan.stream:
        outcome = await collect(server.runtime, prepared, request)
        output = shape.output_items(outcome)
        shape.keep(output, outcome)
        return JSONResponse(shape.response("completed", output, outcome))
    return StreamingResponse(response_events(server, prepared, request, shape), media_type="text/event-stream",
                             headers=SSE_HEADERS)
