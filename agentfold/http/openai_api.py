"""OpenAI Chat Completions, legacy Completions and the model list.

Streams follow what openai-python, litellm, the AI SDK and Codex's chat parser accept: a first
chunk with the role, content chunks (and `reasoning_content` chunks: a harmony model's analysis
channel, llama.cpp's and vLLM's field; `message.reasoning_content` when not streamed), tool-call deltas that carry `index` on every element and
`id` / `type` / `name` only on a call's first, a final chunk with `finish_reason` (and the
`timings` / `agentfold` telemetry), a usage chunk with `choices: []` only when
`stream_options.include_usage` asked for it, then `data: [DONE]`.

`logprobs` (chat: `logprobs` / `top_logprobs`; completions: `logprobs: N`) come from the very row
of logits that chose each token (`engine.sampler.token_logprob`), so a drafted reply's logprobs
equal the serial reply's bit for bit. Image, audio and file parts are a 400: the model reads text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from agentfold import __version__
from agentfold.chat.harmony import ReasoningPiece
from agentfold.chat.plan import ChatPlan, check_schema, parse_tool_choice
from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall, ToolSpec
from agentfold.engine.decode import Delta
from agentfold.engine.detokenizer import token_bytes
from agentfold.engine.sampler import TokenLogprob
from agentfold.http.errors import ApiError
from agentfold.http.fields import (
    get_bool,
    get_float,
    get_int,
    get_prediction,
    get_stop,
    read_turn_fields,
)
from agentfold.http.stream import KEEPALIVE, SSE_HEADERS, Heartbeat, Outcome, collect, drive, new_id, now, prepare, sse
from agentfold.serve.chat_turn import PreparedTurn

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
FINGERPRINT = f"agentfold-{__version__}"


def openai_error(error: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": error.message, "type": error.type, "code": error.code,
                                   "param": error.param}}, status_code=error.status)


# ---------------------------------------------------------------------------------------------
# Request parsing (shared with the Responses API where the shapes agree)
# ---------------------------------------------------------------------------------------------

# Content parts a text-only model cannot read (OpenAI Chat Completions and Responses names).
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video_url")


def content_text(content: Any, where: str, text_only: bool = False) -> str:
    """Message content (string, or array of text parts) as text.

    With `text_only`, an image / audio / file part is a 400 naming the part: the served models
    read text only, and dropping the part would answer a question about an image the model never
    saw. Without it (the Responses API's current use) such parts are skipped.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                kind = part.get("type") or next((key for key in MEDIA_PARTS if key in part), None)
                if text_only and kind in MEDIA_PARTS:
                    raise _media_error(kind, f"{where}[{j}]")
                if isinstance(text, str):
                    parts.append(text)
                elif part.get("type") in ("text", "input_text", "output_text"):
                    raise ApiError(f"'{where}[{j}].text' must be a string.", param=where)
            else:
                raise ApiError(f"'{where}[{j}]' must be an object, not {type(part).__name__}.", param=where)
        return "\n".join(parts)
    raise ApiError(f"'{where}' must be a string or an array of content parts.", param=where)


def _media_error(kind: Any, where: str) -> ApiError:
    """400 for a content part the model cannot read (an image, audio, a file)."""
    return ApiError(f"'{where}' is a content part of type {json.dumps(kind)}, but the served model is "
                    "text-only: it reads text parts only. Describe the content in a text part instead.",
                    code="unsupported_content", param=where)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError("'messages' must be an array of messages.", param="messages")
    if not value:
        raise ApiError("'messages' is empty; send at least one message.", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"'{where}' must be an object with 'role' and 'content'.", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"'{where}.role' must be one of {', '.join(ROLES)}, not {json.dumps(role)}.",
                           param=f"{where}.role")
        text = content_text(message.get("content"), f"{where}.content", text_only=True)
        entry: dict[str, Any] = {"role": "tool" if role == "function" else role, "content": text}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if role == "assistant" and isinstance(reasoning, str) and reasoning:
            entry["thinking"] = reasoning  # earlier reasoning sent back: the template's `thinking` (gpt-oss)
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ApiError(f"'{where}.tool_calls' must be an array.", param=f"{where}.tool_calls")
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(f"'{where}.tool_calls[{j}].function.name' must be a string.",
                                   param=f"{where}.tool_calls")
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, (str, dict)):
                    raise ApiError(f"'{where}.tool_calls[{j}].function.arguments' must be a JSON string.",
                                   param=f"{where}.tool_calls")
                entry["tool_calls"].append({"id": call.get("id", ""), "type": "function",
                                            "function": {"name": function["name"], "arguments": arguments}})
        elif role in ("system", "developer", "user") and message.get("content") is None:
            raise ApiError(f"'{where}.content' is missing; a {role} message needs content.", param=f"{where}.content")
        if role in ("tool", "function"):
            entry["tool_call_id"] = message.get("tool_call_id") or message.get("name") or ""
        out.append(entry)
    return out


def parse_function_tools(value: Any, param: str = "tools", flat: bool = False) -> list[ToolSpec]:
    """Function tools; other tool types are dropped (clients send what they have, not what we run)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(f"'{param}' must be an array of tools.", param=param)
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ApiError(f"'{param}[{i}]' must be an object.", param=param)
        if tool.get("type", "function") != "function":
            continue
        function = tool if flat else tool.get("function")
        if not isinstance(function, dict):
            raise ApiError(f"'{param}[{i}].function' must be an object with a name.", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(f"'{param}[{i}]' needs a non-empty 'name'.", param=param)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ApiError(f"'{param}[{i}].description' must be a string.", param=param)
        tools.append(ToolSpec(name, description, check_schema(function.get("parameters"), f"'{param}[{i}].parameters'")))
    return tools


def parse_response_format(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(f"'{param}' must be an object with type 'text', 'json_object' or 'json_schema'.", param=param)
    if value["type"] == "json_schema":
        inner = value.get("json_schema") or value
        if not isinstance(inner, dict):
            raise ApiError(f"'{param}.json_schema' must be an object holding a 'schema'.", param=param)
        if inner.get("schema") is not None and not isinstance(inner["schema"], dict):
            raise ApiError(f"'{param}' schema must be a JSON schema object.", param=param)
    return None if value["type"] == "text" else value


def common_fields(plan: ChatPlan, body: dict[str, Any], request: Request) -> ChatPlan:
    """The sampling and AgentFold fields every OpenAI-shaped endpoint accepts."""
    plan.temperature = get_float(body, "temperature", 0.0, 2.0, default=0.0)
    plan.top_p = get_float(body, "top_p", 0.0, 1.0, default=1.0, open_minimum=True)
    top_k = get_int(body, "top_k", default=0)
    plan.top_k = 0 if top_k < 0 else top_k  # llama.cpp: <= 0 means off
    plan.min_p = get_float(body, "min_p", 0.0, 1.0, default=0.0)
    read_turn_fields(plan, body, request)
    n = get_int(body, "n", default=1)
    if n != 1:
        raise ApiError(f"'n' must be 1 here (one choice per request), not {n}.", param="n")
    return plan


def max_tokens_field(body: dict[str, Any], *keys: str) -> tuple[int | None, str]:
    """The first of `keys` present and its name (aliases: n_predict > max_completion_tokens > max_tokens)."""
    for key in keys:
        if body.get(key) is not None:
            value = get_int(body, key)
            if key == "n_predict" and value is not None and value < 0:
                return None, key  # llama.cpp: -1 = until the context is full
            if value is not None and value < 1:
                raise ApiError(f"'{key}' must be >= 1, not {value}.", param=key)
            return value, key
    return None, keys[-1]


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object.", param="stream_options")
    return bool(options.get("include_usage"))


def usage_block(outcome: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens,
                                          **outcome.completion.stats.prediction_tokens()}}


# ---------------------------------------------------------------------------------------------
# Logprobs (Chat Completions `logprobs` / `top_logprobs`, Completions `logprobs: N`)
# ---------------------------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives per token the reply reports (None: no logprobs)."""
    wanted = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise ApiError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return (top or 0) if wanted else None


def _token_json(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs_block(runtime: Any, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's `choices[].logprobs` of Chat Completions for these tokens (an end-of-turn token is left out)."""
    if entries is None:
        return None
    tokenizer, eos = runtime.tokenizer, runtime.engine.eos_token_ids
    content = [{**_token_json(tokenizer, e.token, e.logprob),
                "top_logprobs": [_token_json(tokenizer, t, lp) for t, lp in e.top]}
               for e in entries if e.token not in eos]
    return {"content": content, "refusal": None}


def completion_logprobs_block(runtime: Any, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """The legacy Completions `logprobs` object; `text_offset` counts from the reply's start (+ `offset`)."""
    if entries is None:
        return None
    tokenizer, eos = runtime.tokenizer, runtime.engine.eos_token_ids
    block: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in (e for e in entries if e.token not in eos):
        text = _token_json(tokenizer, entry.token, entry.logprob)["token"]
        block["tokens"].append(text)
        block["token_logprobs"].append(entry.logprob)
        block["top_logprobs"].append({_token_json(tokenizer, t, lp)["token"]: lp for t, lp in entry.top})
        block["text_offset"].append(offset)
        offset += len(text)
    return block


class LogprobStream:
    """Logprobs for a streamed reply: each Delta's as it comes (when the stream passes Deltas on),
    and what is left with the final chunk, so the chunks together carry every token's."""

    def __init__(self, count: int | None) -> None:
        self.enabled = count is not None
        self.pending: list[TokenLogprob] = []
        self.sent = 0

    def add(self, delta: Delta) -> None:
        self.pending.extend(delta.logprobs or [])

    def take(self, outcome: Outcome | None = None) -> list[TokenLogprob] | None:
        """The entries not yet streamed (at the end: every one the Outcome has that was not)."""
        if not self.enabled:
            return None
        if outcome is not None:
            self.pending = list((outcome.completion.logprobs or [])[self.sent:])
        taken, self.pending = self.pending, []
        self.sent += len(taken)
        return taken or None


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------

def chat_plan(body: dict[str, Any], request: Request) -> ChatPlan:
    tools = parse_function_tools(body.get("tools"))
    plan = ChatPlan(messages=parse_messages(body.get("messages")), tools=tools)
    common_fields(plan, body, request)
    plan.tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    plan.parallel_tool_calls = get_bool(body, "parallel_tool_calls", True)
    plan.response_format = parse_response_format(body.get("response_format"))
    plan.max_tokens, plan.max_tokens_param = max_tokens_field(body, "n_predict", "max_completion_tokens", "max_tokens")
    plan.stop = get_stop(body, "stop")
    plan.prediction = get_prediction(body)
    return plan


async def chat_completions(server, request: Request, body: dict[str, Any]):
    plan = chat_plan(body, request)
    usage_wanted = include_usage(body)
    plan.logprobs = chat_logprobs(body)
    prepared = prepare(server.runtime, plan, "chat", request, server.default_max_tokens)
    model = plan.model or server.runtime.model_id
    chat_id, created = new_id("chatcmpl-"), now()
    if plan.stream:
        head = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": FINGERPRINT}
        events = _chat_events(server, prepared, request, head, usage_wanted, LogprobStream(plan.logprobs))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    outcome = await collect(server.runtime, prepared, request)
    calls = [_call_json(call) for call in outcome.calls]
    message: dict[str, Any] = {"role": "assistant", "content": (outcome.content or None) if calls else outcome.content}
    if outcome.reasoning:
        message["reasoning_content"] = outcome.reasoning  # llama.cpp's and vLLM's field
    if calls:
        message["tool_calls"] = calls
    return JSONResponse({
        "id": chat_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": message,
                     "logprobs": chat_logprobs_block(server.runtime, outcome.completion.logprobs),
                     "finish_reason": outcome.finish}],
        "usage": usage_block(outcome), "timings": outcome.timings, "agentfold": outcome.agentfold,
    })


async def _chat_events(server, prepared: PreparedTurn, request: Request, head: dict[str, Any], usage_wanted: bool,
                       logprobs: LogprobStream) -> AsyncIterator[str]:
    """The chat.completion.chunk stream of one turn (see the module docstring for its shape)."""

    def chunk(delta: dict[str, Any], finish: str | None = None, entries: list[TokenLogprob] | None = None,
              **extra: Any) -> str:
        block = chat_logprobs_block(server.runtime, entries)
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": block, "finish_reason": finish}],
                    **extra})

    yield chunk({"role": "assistant", "content": ""})
    index = 0
    try:
        async for item in drive(server.runtime, prepared, request):
            if isinstance(item, Heartbeat):
                yield KEEPALIVE
            elif isinstance(item, Delta):
                logprobs.add(item)
            elif isinstance(item, TextPiece):
                yield chunk({"content": item.text}, entries=logprobs.take())
            elif isinstance(item, ReasoningPiece):
                yield chunk({"reasoning_content": item.text}, entries=logprobs.take())
            elif isinstance(item, ToolCall):
                item.id = item.id or new_id("call_")
                yield chunk({"tool_calls": [{"index": index, "id": item.id, "type": "function",
                                             "function": {"name": item.name, "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]})
                index += 1
            else:
                yield chunk({}, item.finish, entries=logprobs.take(item), timings=item.timings,
                            agentfold=item.agentfold)
                if usage_wanted:
                    yield sse({**head, "choices": [], "usage": usage_block(item), "timings": item.timings,
                               "agentfold": item.agentfold})
    except ApiError as error:
        yield sse({"error": {"message": error.message, "type": error.type, "code": error.code, "param": error.param}})
    except Exception as error:  # mid-stream: the status is already sent, so say it in the stream
        log.exception("chat stream failed")
        yield sse({"error": {"message": f"generation failed: {error}", "type": "server_error", "code": None,
                             "param": None}})
    yield sse("[DONE]")


def _call_json(call: ToolCall) -> dict[str, Any]:
    call.id = call.id or new_id("call_")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------

def _raw_prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return _raw_prompt(value[0])
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and len(value) > 1:
        raise ApiError("'prompt' may hold one prompt per request here, not a batch.", param="prompt")
    raise ApiError("'prompt' must be a string (or an array of token ids).", param="prompt")


def completions_plan(server, body: dict[str, Any], request: Request) -> ChatPlan:
    if "prompt" not in body:
        raise ApiError("'prompt' is required.", param="prompt")
    plan = ChatPlan(messages=[], raw_prompt=_raw_prompt(body.get("prompt")))
    common_fields(plan, body, request)
    plan.max_tokens, plan.max_tokens_param = max_tokens_field(body, "n_predict", "max_tokens")
    if plan.max_tokens is None and body.get("n_predict") is None:
        plan.max_tokens = 16  # the OpenAI default for this endpoint
    plan.stop = get_stop(body, "stop")
    if isinstance(plan.raw_prompt, list):
        vocab = server.runtime.engine.backend.vocab_size
        if vocab and any(t < 0 or t >= vocab for t in plan.raw_prompt):
            raise ApiError(f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1}).", param="prompt")
    return plan


async def completions(server, request: Request, body: dict[str, Any]):
    plan = completions_plan(server, body, request)
    usage_wanted = include_usage(body)
    plan.logprobs = get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    prepared = prepare(server.runtime, plan, "completions", request, server.default_max_tokens)
    model = plan.model or server.runtime.model_id
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": model,
            "system_fingerprint": FINGERPRINT}
    if not plan.stream:
        outcome = await collect(server.runtime, prepared, request)
        block = completion_logprobs_block(server.runtime, outcome.completion.logprobs)
        return JSONResponse({**head, "choices": [{"index": 0, "text": outcome.content, "logprobs": block,
                                                  "finish_reason": outcome.finish}],
                             "usage": usage_block(outcome), "timings": outcome.timings, "agentfold": outcome.agentfold})
    stream = LogprobStream(plan.logprobs)

    def chunk(text: str, offset: int, finish: str | None = None, entries: list[TokenLogprob] | None = None,
              **extra: Any) -> str:
        block = completion_logprobs_block(server.runtime, entries, offset)
        return sse({**head, "choices": [{"index": 0, "text": text, "logprobs": block, "finish_reason": finish}],
                    **extra})

    async def events() -> AsyncIterator[str]:
        offset = 0  # characters streamed so far: where the next chunk's tokens start
        try:
            async for item in drive(server.runtime, prepared, request):
                if isinstance(item, Heartbeat):
                    yield KEEPALIVE
                elif isinstance(item, Delta):
                    stream.add(item)
                elif isinstance(item, TextPiece):
                    yield chunk(item.text, offset, entries=stream.take())
                    offset += len(item.text)
                elif isinstance(item, Outcome):
                    yield chunk("", offset, item.finish, entries=stream.take(item), timings=item.timings,
                                agentfold=item.agentfold)
                    if usage_wanted:
                        yield sse({**head, "choices": [], "usage": usage_block(item)})
        except Exception as error:
            log.exception("completion stream failed")
            yield sse({"error": {"message": f"generation failed: {error}", "type": "server_error", "code": None,
                                 "param": None}})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


# ---------------------------------------------------------------------------------------------
# /v1/models
# ---------------------------------------------------------------------------------------------

def models(server) -> dict[str, Any]:
    """OpenAI's list (`data`), Anthropic's fields on the same entries, and Codex's `models` cards.

    One entry per model, its other names in `aliases` (listing each name as a model made clients
    and `agentfold integrate` offer one model three times). Codex looks its model up by slug, so
    every alias keeps a card, hidden from its model picker (`visibility: "hide"`).
    """
    runtime = server.runtime
    created = int(runtime.started_at)
    iso = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    data = [{"id": runtime.model_id, "object": "model", "type": "model", "created": created, "created_at": iso,
             "owned_by": "agentfold", "display_name": runtime.model_id, "context_length": runtime.context_length,
             "aliases": list(runtime.aliases)}]
    cards = [{"slug": name, "display_name": name, "description": f"{runtime.model_id} served by AgentFold",
              "context_window": runtime.context_length, "max_context_window": runtime.context_length,
              "default_reasoning_level": None, "supported_reasoning_levels": [], "shell_type": "shell_command",
              "visibility": "list" if name == runtime.model_id else "hide", "supported_in_api": True,
              "priority": 0, "upgrade": None, "base_instructions": None, "supports_reasoning_summaries": False,
              "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": None,
              "input_modalities": ["text"], "supports_parallel_tool_calls": True} for name in runtime.model_names]
    return {"object": "list", "data": data, "models": cards, "has_more": False,
            "first_id": data[0]["id"], "last_id": data[-1]["id"]}
