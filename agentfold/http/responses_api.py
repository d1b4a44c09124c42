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
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentfold.chat.plan import ChatPlan, ContextOverflow, check_schema, parse_tool_choice
from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall, ToolSpec
from agentfold.http.errors import ApiError
from agentfold.http.fields import get_bool, get_int, get_str
from agentfold.http.openai_api import common_fields, content_text, parse_response_format
from agentfold.http.response_store import MAX_RESPONSES, ResponseStore
from agentfold.http.stream import SSE_HEADERS, Heartbeat, Outcome, collect, drive, new_id, now, prepare, sse
from agentfold.serve.chat_turn import PreparedTurn
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
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"'{where}' must be an object.", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        _check_text_only(item.get("content"), f"{where}.content")
        _check_text_only(item.get("output"), f"{where}.output")
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


@dataclass
class ResponseShape:
    """What every Responses object of one reply carries (its id, the request's echo) and its item builders."""

    body: dict[str, Any]
    plan: ChatPlan
    custom: set[str]  # custom tools: their calls are `custom_tool_call` items
    model: str
    instructions: str | None
    previous_id: str | None = None
    store: ResponseStore | None = None  # where the reply is kept for `previous_response_id` (None: store false)
    new_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, kept with the reply
    resp_id: str = field(default_factory=lambda: new_id("resp_"))
    created: int = field(default_factory=now)

    def response(self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None) -> dict[str, Any]:
        """The `response` object, with usage and telemetry once the turn has its Outcome."""
        body, plan = self.body, self.plan
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        obj: dict[str, Any] = {
            "id": self.resp_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": None,
            "instructions": self.instructions,
            "max_output_tokens": plan.max_tokens, "parallel_tool_calls": plan.parallel_tool_calls,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": plan.temperature, "top_p": plan.top_p, "metadata": metadata,
            "previous_response_id": self.previous_id, "store": self.store is not None, "truncation": "disabled",
            "usage": None,
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

    def keep(self, output: list[dict[str, Any]], outcome: Outcome) -> None:
        """Keep this reply (its new input and its output) for a later `previous_response_id`."""
        if self.store is not None:
            session = outcome.agentfold.get("session_id") if isinstance(outcome.agentfold, dict) else None
            self.store.put(self.resp_id, self.previous_id, [*self.new_items, *output], session or self.plan.session_id)

    @staticmethod
    def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        """An assistant `message` item (its content only once completed)."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": item_id or new_id("msg_"), "status": status, "role": "assistant",
                "content": content}

    def call_item(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        """A `function_call` item, or a `custom_tool_call` carrying the free-form `input` text."""
        call.id = call.id or new_id("call_")
        if call.name in self.custom:
            text = call.arguments_obj.get("input", "")
            return {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call.id, "name": call.name,
                    "input": text if isinstance(text, str) else str(text), "status": status}
        return {"type": "function_call", "id": new_id("fc_"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}


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
        return StreamingResponse(_overflow_events(shape, overflow), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not plan.stream:
        outcome = await collect(server.runtime, prepared, request)
        output = [shape.message_item(outcome.content)] if outcome.content or not outcome.calls else []
        output += [shape.call_item(call) for call in outcome.calls]
        shape.keep(output, outcome)
        return JSONResponse(shape.response("completed", output, outcome))
    return StreamingResponse(_events(server, prepared, request, shape), media_type="text/event-stream",
                             headers=SSE_HEADERS)


class _ResponseStream:
    """The event sequence of one streamed reply: numbered events, the output items so far."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.open_message: dict[str, Any] | None = None
        self.text_parts: list[str] = []

    def event(self, kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(self.seq), **fields}, event=kind)

    def text(self, piece: TextPiece) -> list[str]:
        """Content text: opens a message item (and its text part) on the first piece."""
        lines = []
        if self.open_message is None:
            self.open_message = self.shape.message_item("", "in_progress")
            self.text_parts.clear()
            lines.append(self.event("response.output_item.added", output_index=len(self.output),
                                    item=self.open_message))
            lines.append(self.event("response.content_part.added", item_id=self.open_message["id"],
                                    output_index=len(self.output), content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.text_parts.append(piece.text)
        lines.append(self.event("response.output_text.delta", item_id=self.open_message["id"],
                                output_index=len(self.output), content_index=0, delta=piece.text, logprobs=[]))
        return lines

    def close_message(self) -> list[str]:
        """Finish the open message item, if any: its text, part and item `done` events."""
        if self.open_message is None:
            return []
        index, item_id, text = len(self.output), self.open_message["id"], "".join(self.text_parts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        done = self.shape.message_item(text, item_id=item_id)
        self.output.append(done)
        self.open_message = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=done)]

    def tool_call(self, call: ToolCall) -> list[str]:
        """A settled call as one item: added, its whole arguments (or input) as one delta, done."""
        lines = self.close_message()
        done = self.shape.call_item(call)
        index = len(self.output)
        started = {**done, "status": "in_progress"}
        custom_call = done["type"] == "custom_tool_call"
        if custom_call:
            started["input"] = ""
        else:
            started["arguments"] = ""
        lines.append(self.event("response.output_item.added", output_index=index, item=started))
        if custom_call:
            lines.append(self.event("response.custom_tool_call_input.delta", item_id=done["id"], output_index=index,
                                    delta=done["input"]))
            lines.append(self.event("response.custom_tool_call_input.done", item_id=done["id"], output_index=index,
                                    input=done["input"]))
        else:
            lines.append(self.event("response.function_call_arguments.delta", item_id=done["id"],
                                    output_index=index, delta=done["arguments"]))
            lines.append(self.event("response.function_call_arguments.done", item_id=done["id"],
                                    output_index=index, name=done["name"], arguments=done["arguments"]))
        self.output.append(done)
        lines.append(self.event("response.output_item.done", output_index=index, item=done))
        return lines

    def completed(self, outcome: Outcome) -> list[str]:
        lines = self.close_message()
        self.shape.keep(self.output, outcome)
        return [*lines, self.event("response.completed", response=self.shape.response("completed", self.output, outcome))]

    def failed(self, error: Exception) -> str:
        """`response.failed` with the error's code and message (an ApiError's own, else server_error)."""
        status_error = error if isinstance(error, ApiError) else None
        if status_error is None:
            log.exception("responses stream failed")
        failed = self.shape.response("failed", self.output)
        failed["error"] = {"code": (status_error.code if status_error else None) or "server_error",
                           "message": status_error.message if status_error else f"generation failed: {error}"}
        return self.event("response.failed", response=failed)


async def _overflow_events(shape: ResponseShape, error: ApiError) -> AsyncIterator[str]:
    """A streamed request whose prompt does not fit: `response.failed` with `context_length_exceeded`,
    the one form of it Codex (0.171) reads as a full context window (an HTTP 400 is an invalid request
    to it); non-streamed requests get the 400 with that code."""
    stream = _ResponseStream(shape)
    yield stream.event("response.created", response=shape.response("in_progress", []))
    yield stream.failed(error)


async def _events(server: Any, prepared: PreparedTurn, request: Request, shape: ResponseShape) -> AsyncIterator[str]:
    stream = _ResponseStream(shape)
    yield stream.event("response.created", response=shape.response("in_progress", []))
    yield stream.event("response.in_progress", response=shape.response("in_progress", []))
    try:
        async for item in drive(server.runtime, prepared, request):
            if isinstance(item, Heartbeat):  # a long prefill: the response is still in progress
                lines = [stream.event("response.in_progress", response=shape.response("in_progress", stream.output))]
            elif isinstance(item, TextPiece):
                lines = stream.text(item)
            elif isinstance(item, ToolCall):
                lines = stream.tool_call(item)
            else:
                lines = stream.completed(item)
            for line in lines:
                yield line
    except Exception as error:
        yield stream.failed(error)
