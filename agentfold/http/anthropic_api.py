"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`), as Claude Code uses them.

Claude Code (2.1.332, recorded in tests/fixtures/claude_code/) sends `system` as a block array,
a `system` message inside `messages` after the first user message (its environment), `tool_use`
/ `tool_result` blocks, `max_tokens` far above a local model's context, and the beta fields below,
on `/v1/messages?beta=true`. The stream is the full event sequence: `message_start`, `ping`, per
block `content_block_start` / `_delta` (`text_delta`, `input_json_delta`) / `_stop` (text first,
then tool_use blocks), `message_delta` with the stop reason and usage, `message_stop`.
Anthropic's `input_tokens` excludes cache reads, which are reported as `cache_read_input_tokens`.

What the request's extra fields do here (none is ever a 400 for being there):

- honoured: `metadata.user_id` when it is a JSON string holding `session_id` (Claude Code's
  session) and the `X-Claude-Code-Session-Id` header are the session key, unless `session_id` or
  `X-Session-Id` name one; `output_config.format` (`{"type": "json_schema", "schema": ...}`)
  constrains the reply like OpenAI's `response_format`; `max_tokens` beyond what the context
  leaves is clamped to it (reported as `agentfold.max_tokens_clamped`), as llama-server does.
- accepted and ignored: `thinking` (the served model has no separate thinking budget),
  `context_management` (nothing is edited out of the prompt: the history is resent whole, and
  the session cache depends on it staying the same),
  `output_config.effort`, `metadata`'s other keys, `service_tier`, `container`, `mcp_servers`,
  the `anthropic-beta` / `anthropic-version` headers and `?beta=true` (one endpoint serves both),
  `cache_control` on blocks (every prefix is cached anyway, in the session).
- earlier `thinking` blocks of an assistant message are its `thinking`, which only a template
  that reads it renders (gpt-oss's, before a tool call); other templates never see them. A harmony
  model's (gpt-oss's) analysis text comes back as a `thinking` block (`signature` empty) before
  the text and tool_use blocks, streamed as `content_block_start` / `thinking_delta` /
  `content_block_stop`.
- refused: `image` and `document` blocks (a 400: the served model reads text only; dropping them
  would answer a question about a picture it never saw).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from agentfold.chat.harmony import ReasoningPiece
from agentfold.chat.plan import ChatPlan, ContextOverflow, check_schema, parse_tool_choice
from agentfold.chat.template import render_chat
from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall, ToolSpec
from agentfold.http.errors import ApiError
from agentfold.http.fields import (
    client_session_id,
    get_float,
    get_int,
    get_stop,
    read_turn_fields,
)
from agentfold.http.stream import SSE_HEADERS, Heartbeat, Outcome, collect, drive, new_id, prepare, sse
from agentfold.serve.chat_turn import PreparedTurn

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(error: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": error.message}},
                        status_code=error.status)


TEXT_ONLY_BLOCKS = ("image", "document")  # blocks a text-only model cannot read: a 400, not dropped


def _refuse_media(kind: Any, where: str) -> None:
    if kind in TEXT_ONLY_BLOCKS:
        raise ApiError(f"{where}: the served model is text-only and cannot read {kind} blocks; "
                       f"send the content as text instead.", param=where)


def _blocks_text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(f"'{where}' must be a string or an array of content blocks.")
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise ApiError(f"'{where}[{j}]' must be an object.")
        _refuse_media(block.get("type"), f"{where}.{j}")
        if block.get("type", "text") == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise ApiError(f"'{where}[{j}].text' must be a string.")
            parts.append(text)
    return "\n".join(parts)


def parse_messages(value: Any, system: Any) -> list[dict[str, Any]]:
    """Anthropic messages (+ system) as chat messages: tool_result blocks become tool messages.

    A `system` message inside `messages` (string or text blocks) stays where it is: the template
    renders it there (agentfold.chat.template), so later turns still extend this prompt.
    """
    if not isinstance(value, list):
        raise ApiError("messages: must be an array of messages.")
    if not value:
        raise ApiError("messages: at least one message is required.")
    out: list[dict[str, Any]] = []
    system_text = _blocks_text(system, "system")
    if system_text:
        out.append({"role": "system", "content": system_text})
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise ApiError(f"{where}: must be an object with 'role' and 'content'.")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise ApiError(f"{where}.role: must be 'user', 'assistant' or 'system', not {json.dumps(role)}.")
        content = message.get("content")
        if content is None:
            raise ApiError(f"{where}.content: field required.")
        if role == "system":
            text = _blocks_text(content, f"{where}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(f"{where}.content: must be a string or an array of content blocks.")
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            bwhere = f"{where}.content.{j}"
            if not isinstance(block, dict):
                raise ApiError(f"{bwhere}: must be an object.")
            kind = block.get("type")
            _refuse_media(kind, bwhere)
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise ApiError(f"{bwhere}.text: must be a string.")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                name = block.get("name")
                if not isinstance(name, str) or not name:
                    raise ApiError(f"{bwhere}.name: must be a non-empty string.")
                arguments = block.get("input") if block.get("input") is not None else {}
                if not isinstance(arguments, dict):
                    raise ApiError(f"{bwhere}.input: must be an object.")
                calls.append({"id": block.get("id", ""), "type": "function",
                              "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            elif kind == "thinking" and role == "assistant":
                if isinstance(block.get("thinking"), str) and block["thinking"]:
                    thoughts.append(block["thinking"])
            elif kind == "tool_result" and role == "user":
                text = _blocks_text(block.get("content"), f"{bwhere}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": text})
            # redacted_thinking, server tool blocks: nothing to render
        if role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if thoughts:
                entry["thinking"] = "\n\n".join(thoughts)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def parse_tools(value: Any) -> list[ToolSpec]:
    """Client tools; Anthropic-defined server tools (typed: bash_..., web_search_...) are dropped."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError("tools: must be an array of tools.")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ApiError(f"tools.{i}: must be an object.")
        if tool.get("type") not in (None, "custom"):
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(f"tools.{i}.name: must be a non-empty string.")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(f"tools.{i}.description: must be a string.")
        tools.append(ToolSpec(name, description, check_schema(tool.get("input_schema"), f"tools.{i}.input_schema")))
    return tools


def messages_plan(body: dict[str, Any], request: Request) -> ChatPlan:
    tools = parse_tools(body.get("tools"))
    plan = ChatPlan(messages=parse_messages(body.get("messages"), body.get("system")), tools=tools)
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict):
        raise ApiError("tool_choice: must be an object such as {\"type\": \"auto\"}.")
    plan.tool_choice = parse_tool_choice(choice, tools)
    plan.parallel_tool_calls = not bool((choice or {}).get("disable_parallel_tool_use", False))
    plan.max_tokens = get_int(body, "max_tokens", minimum=1)
    plan.temperature = get_float(body, "temperature", 0.0, 1.0, default=0.0)
    plan.top_p = get_float(body, "top_p", 0.0, 1.0, default=1.0, open_minimum=True)
    top_k = get_int(body, "top_k", default=0)
    plan.top_k = max(0, top_k)
    plan.min_p = get_float(body, "min_p", 0.0, 1.0, default=0.0)
    plan.stop = get_stop(body, "stop_sequences")
    plan.response_format = _output_format(body.get("output_config"))
    read_turn_fields(plan, body, request)
    if plan.session_id is None:
        plan.session_id = client_session_id(body)
    return plan


def _output_format(config: Any) -> dict[str, Any] | None:
    """`output_config.format` as a response_format (JSON schema output); `effort` and the rest are ignored."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise ApiError("output_config.format.schema: must be a JSON schema object.", param="output_config")
    return {"type": "json_schema", "schema": schema}


def _usage(outcome: Outcome) -> dict[str, Any]:
    return {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": outcome.cached_tokens,
            "output_tokens": outcome.completion_tokens}


def _stop_reason(outcome: Outcome) -> str:
    if outcome.calls:
        return "tool_use"
    if outcome.finish == "length":
        return "max_tokens"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _tool_block(call: ToolCall) -> dict[str, Any]:
    call.id = call.id or new_id("toolu_")
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments_obj}


def _content(outcome: Outcome) -> list[dict[str, Any]]:
    """The reply's content blocks: a harmony reply's in the order written (its `thinking` first, as
    the model writes it), else the text (when there is some or no call) and then the tool_use blocks."""
    content: list[dict[str, Any]] = []
    if outcome.blocks is None:
        if outcome.content or not outcome.calls:
            content.append({"type": "text", "text": outcome.content})
        return content + [_tool_block(call) for call in outcome.calls]
    for block in outcome.blocks:
        if isinstance(block, ReasoningPiece):
            content.append({"type": "thinking", "thinking": block.text, "signature": ""})
        elif isinstance(block, TextPiece):
            content.append({"type": "text", "text": block.text})
        else:
            content.append(_tool_block(block))
    if not outcome.content and not outcome.calls:
        content.append({"type": "text", "text": ""})
    return content


def _prepare(server, plan: ChatPlan, request: Request) -> PreparedTurn:
    """The turn, or the 400 Anthropic answers a prompt over the context with: Claude Code matches
    its message, `prompt is too long: N tokens > M maximum`, to compact the conversation."""
    try:
        return prepare(server.runtime, plan, "messages", request, server.default_max_tokens)
    except ContextOverflow as error:
        raise ApiError(error.anthropic_message, code=error.code, param=error.param) from error


async def messages(server, request: Request, body: dict[str, Any]):
    plan = messages_plan(body, request)
    prepared = _prepare(server, plan, request)
    model = plan.model or server.runtime.model_id
    msg_id = new_id("msg_")
    if not plan.stream:
        outcome = await collect(server.runtime, prepared, request)
        return JSONResponse({
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": _content(outcome),
            "stop_reason": _stop_reason(outcome), "stop_sequence": outcome.stop_sequence, "usage": _usage(outcome),
            "timings": outcome.timings, "agentfold": outcome.agentfold,
        })

    async def events() -> AsyncIterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, **fields}, event=kind)

        yield event("message_start", message={
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prepared.prompt_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}})
        yield event("ping")
        blocks = _BlockStream(event)
        try:
            async for item in drive(server.runtime, prepared, request):
                if isinstance(item, Heartbeat):
                    yield event("ping")  # Anthropic's keep-alive: a long prefill is not a dead stream
                    continue
                for line in blocks.item(item):
                    yield line
        except Exception as error:
            if isinstance(error, ApiError):
                kind, message = ERROR_TYPES.get(error.status, "api_error"), error.message
            else:
                log.exception("messages stream failed")
                kind, message = "api_error", f"generation failed: {error}"
            yield event("error", error={"type": kind, "message": message})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


class _BlockStream:
    """A streamed reply's content blocks: text and thinking pieces go to the open block of their kind
    (closing the other), each call is a tool_use block of its own, and the end closes what is open
    (a reply with no text block still gets an empty one) and sends the message's last events."""

    _EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}

    def __init__(self, event: Any) -> None:
        self.event = event
        self.index = 0
        self.open: str | None = None  # "text" / "thinking": the block being streamed into
        self.texts = 0  # text blocks sent

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [self.event("content_block_stop", index=self.index - 1)]

    def _piece(self, kind: str, text: str) -> list[str]:
        lines = self._close() if self.open not in (None, kind) else []
        if self.open is None:
            lines.append(self.event("content_block_start", index=self.index, content_block=dict(self._EMPTY[kind])))
            self.open = kind
            self.texts += kind == "text"
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*lines, self.event("content_block_delta", index=self.index, delta=delta)]

    def item(self, item: Any) -> list[str]:
        if isinstance(item, ReasoningPiece):
            return self._piece("thinking", item.text)
        if isinstance(item, TextPiece):
            return self._piece("text", item.text)
        if isinstance(item, ToolCall):
            block, index = _tool_block(item), self.index + (self.open is not None)
            lines = [*self._close(), self.event("content_block_start", index=index, content_block={**block, "input": {}}),
                     self.event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": item.arguments}),
                     self.event("content_block_stop", index=index)]
            self.index += 1
            return lines
        lines = self._close()
        if not self.texts and not item.calls and not item.content:  # a reply has a text block, empty or not
            lines += [self.event("content_block_start", index=self.index, content_block=dict(self._EMPTY["text"])),
                      self.event("content_block_stop", index=self.index)]
        block = item.agentfold
        return [*lines, self.event("message_delta", delta={"stop_reason": _stop_reason(item),
                                                           "stop_sequence": item.stop_sequence},
                                   usage=_usage(item), timings=item.timings, agentfold=block),
                self.event("message_stop", timings=item.timings, agentfold=block)]


async def count_tokens(server, request: Request, body: dict[str, Any]) -> JSONResponse:
    tools = parse_tools(body.get("tools"))
    chat = parse_messages(body.get("messages"), body.get("system"))
    try:
        text = render_chat(server.runtime.tokenizer, chat, tools or None)
    except Exception as error:
        raise ApiError(f"The model's chat template cannot render these messages: {error}") from error
    return JSONResponse({"input_tokens": len(server.runtime.encode(text))})
