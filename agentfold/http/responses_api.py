"""OpenAI Responses (`POST /v1/responses`), as Codex CLI speaks it.

Codex sends `input` as an item list (messages, `function_call`, `function_call_output`,
`reasoning`, custom tool calls), `instructions`, a mixed `tools` array (function, freeform
`custom` such as apply_patch, hosted tools) and nothing about sampling. Unknown tool types are
dropped, never refused; `custom` tools are offered to the model as a function taking one string
`input` and come back as `custom_tool_call` items. The stream always ends with
`response.completed` (status `incomplete` when the token budget ran out), because Codex treats a
stream without it as broken. The server is stateless: `previous_response_id` and `store` are
ignored.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall, ToolSpec
from agentfold.http.common import (
    SSE_HEADERS,
    ApiError,
    ChatPlan,
    Outcome,
    check_schema,
    collect,
    drive,
    get_bool,
    get_int,
    get_str,
    new_id,
    now,
    parse_tool_choice,
    prepare,
    sse,
)
from agentfold.http.openai_api import common_fields, content_text, parse_response_format
from agentfold.sessions.ids import session_id_for_key

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
SKIPPED_ITEMS = ("reasoning", "item_reference", "web_search_call", "file_search_call", "computer_call",
                 "computer_call_output", "image_generation_call", "code_interpreter_call", "local_shell_call",
                 "local_shell_call_output", "mcp_call", "mcp_list_tools", "compaction")


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
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"'{where}' must be an object.", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise ApiError(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}.",
                               param="input")
            messages.append({"role": role, "content": content_text(item.get("content"), f"{where}.content")})
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
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                             "content": _output_text(item.get("output"), f"{where}.output")})
        elif kind in SKIPPED_ITEMS or kind is None or isinstance(kind, str):
            continue  # reasoning and hosted-tool items: nothing this model can use
    return messages


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


async def responses(server, request: Request, body: dict[str, Any]):
    instructions = get_str(body, "instructions")
    tools, custom = parse_tools(body.get("tools"))
    plan = ChatPlan(messages=parse_input(body.get("input"), instructions), tools=tools)
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
    plan.session_id = plan.session_id or (session_id_for_key(cache_key) if cache_key else None)
    if not plan.messages:
        plan.messages = [{"role": "user", "content": ""}]  # Codex probes with empty input

    prepared = prepare(server.runtime, plan, "responses", request, server.default_max_tokens)
    model = plan.model or server.runtime.model_id
    resp_id, created = new_id("resp_"), now()
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}

    def response_obj(status: str, output: list[dict[str, Any]], outcome: Outcome | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None, "incomplete_details": None, "instructions": instructions,
            "max_output_tokens": plan.max_tokens, "parallel_tool_calls": plan.parallel_tool_calls,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": plan.temperature, "top_p": plan.top_p, "metadata": metadata,
            "previous_response_id": None, "store": False, "truncation": "disabled", "usage": None,
            "text": {"format": plan.response_format or {"type": "text"}},
        }
        if outcome is not None:
            obj["usage"] = {"input_tokens": outcome.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                            "output_tokens": outcome.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
            if outcome.finish == "length":
                obj["status"] = "incomplete"
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
            obj["timings"] = outcome.timings
            obj["agentfold"] = outcome.agentfold
        return obj

    def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": item_id or new_id("msg_"), "status": status, "role": "assistant",
                "content": content}

    def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        call.id = call.id or new_id("call_")
        if call.name in custom:
            text = call.arguments_obj.get("input", "")
            return {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call.id, "name": call.name,
                    "input": text if isinstance(text, str) else str(text), "status": status}
        return {"type": "function_call", "id": new_id("fc_"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}

    if not plan.stream:
        outcome = await collect(server.runtime, prepared, request)
        output = [message_item(outcome.content)] if outcome.content or not outcome.calls else []
        output += [call_item(call) for call in outcome.calls]
        return JSONResponse(response_obj("completed", output, outcome))

    async def events() -> AsyncIterator[str]:
        seq = itertools.count()
        output: list[dict[str, Any]] = []
        open_message: dict[str, Any] | None = None
        text_parts: list[str] = []

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

        def close_message() -> list[str]:
            nonlocal open_message
            if open_message is None:
                return []
            index, item_id, text = len(output), open_message["id"], "".join(text_parts)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = message_item(text, item_id=item_id)
            output.append(done)
            open_message = None
            return [event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                          text=text, logprobs=[]),
                    event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=done)]

        yield event("response.created", response=response_obj("in_progress", []))
        yield event("response.in_progress", response=response_obj("in_progress", []))
        try:
            async for item in drive(server.runtime, prepared, request):
                if isinstance(item, TextPiece):
                    if open_message is None:
                        open_message = message_item("", "in_progress")
                        text_parts.clear()
                        yield event("response.output_item.added", output_index=len(output), item=open_message)
                        yield event("response.content_part.added", item_id=open_message["id"],
                                    output_index=len(output), content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    text_parts.append(item.text)
                    yield event("response.output_text.delta", item_id=open_message["id"], output_index=len(output),
                                content_index=0, delta=item.text, logprobs=[])
                elif isinstance(item, ToolCall):
                    for line in close_message():
                        yield line
                    done = call_item(item)
                    index = len(output)
                    started = {**done, "status": "in_progress"}
                    custom_call = done["type"] == "custom_tool_call"
                    if custom_call:
                        started["input"] = ""
                    else:
                        started["arguments"] = ""
                    yield event("response.output_item.added", output_index=index, item=started)
                    if custom_call:
                        yield event("response.custom_tool_call_input.delta", item_id=done["id"], output_index=index,
                                    delta=done["input"])
                        yield event("response.custom_tool_call_input.done", item_id=done["id"], output_index=index,
                                    input=done["input"])
                    else:
                        yield event("response.function_call_arguments.delta", item_id=done["id"],
                                    output_index=index, delta=done["arguments"])
                        yield event("response.function_call_arguments.done", item_id=done["id"],
                                    output_index=index, name=done["name"], arguments=done["arguments"])
                    output.append(done)
                    yield event("response.output_item.done", output_index=index, item=done)
                else:
                    for line in close_message():
                        yield line
                    yield event("response.completed", response=response_obj("completed", output, item))
        except Exception as error:
            status_error = error if isinstance(error, ApiError) else None
            if status_error is None:
                log.exception("responses stream failed")
            failed = response_obj("failed", output)
            failed["error"] = {"code": (status_error.code if status_error else None) or "server_error",
                               "message": status_error.message if status_error else f"generation failed: {error}"}
            yield event("response.failed", response=failed)

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
