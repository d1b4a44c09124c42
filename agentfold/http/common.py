"""What the three wire formats share: validation, the turn pipeline, SSE and the telemetry blocks.

Every API parses its own request into a `ChatPlan` (messages in OpenAI chat shape, tools,
sampling, limits), `prepare` turns a plan into a `TurnRequest` (render, force a tool-call prefix,
tokenize, check the context window), and `drive` runs it on the runtime and yields content text,
tool calls and finally an `Outcome`. The API modules only translate those into their own events.

Validation is lenient about what it does not know (unknown fields are ignored) and strict about
what it does: a wrong type or out-of-range value is an `ApiError` (a 4xx in the API's own shape)
whose message says what to fix, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agentfold.chat.cuts import memo_for, message_cuts, tools_salt
from agentfold.chat.template import render_chat, trailing_instruction
from agentfold.chat.tool_calls import TextPiece, ToolCallParser
from agentfold.chat.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, ToolSpec
from agentfold.engine.constraints import json_object_grammar, json_schema_grammar, tool_call_grammar
from agentfold.engine.decode import Completion, Delta, GenerationConfig
from agentfold.engine.sampler import SamplingParams
from agentfold.http.report import turn_blocks
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES
from agentfold.serve.scheduler import Runtime, RuntimeBusy, RuntimeClosed, Turn, TurnRequest
from agentfold.sessions.ids import check_session_id

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the client must fix (or a server state it must wait out), with its HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------
# Reading and checking request bodies
# ---------------------------------------------------------------------------------------------

async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, counted while read: past `limit` bytes it is a 413 (chunked bodies have no length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"The request body is larger than {limit} bytes, the most this server accepts "
                           "(raise it with --max-body-bytes).", status=413, code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, or a 4xx that says what is wrong with it."""
    raw = await read_body(request, limit)
    if not raw.strip():
        raise ApiError("The request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ApiError(f"The request body is not valid UTF-8 (byte {error.start}: {raw[error.start:error.start + 1]!r}); "
                       "send JSON encoded as UTF-8.") from error
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ApiError(f"The request body is not valid JSON: {error}.") from error
    _check_strings(body)
    if not isinstance(body, dict):
        raise ApiError(f"The request body must be a JSON object, not {_kind(body)}.")
    return body


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates (JSON `\\ud800` escapes): no tokenizer, log or database can take them."""
    stack = [value]
    while stack:  # iterative: a deeply nested body must not exhaust the recursion limit
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ApiError("The request holds a string with an unpaired surrogate escape (e.g. \\ud800); "
                               "send valid Unicode text.") from error
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def get_int(body: dict, key: str, minimum: int | None = None, maximum: int | None = None,
            default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ApiError(f"'{key}' must be an integer, not {_kind(value)} ({json.dumps(value)[:40]}).", param=key)
    value = int(value)
    if minimum is not None and value < minimum:
        raise ApiError(f"'{key}' must be >= {minimum}, not {value}.", param=key)
    if maximum is not None and value > maximum:
        raise ApiError(f"'{key}' must be <= {maximum}, not {value}.", param=key)
    return value


def get_float(body: dict, key: str, minimum: float | None = None, maximum: float | None = None,
              default: float | None = None, open_minimum: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ApiError(f"'{key}' must be a number, not {_kind(value)}.", param=key)
    value = float(value)
    if minimum is not None and (value <= minimum if open_minimum else value < minimum):
        bound = f"> {minimum:g}" if open_minimum else f">= {minimum:g}"
        raise ApiError(f"'{key}' must be {bound}, not {value:g}.", param=key)
    if maximum is not None and value > maximum:
        raise ApiError(f"'{key}' must be <= {maximum:g}, not {value:g}.", param=key)
    return value


def get_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{key}' must be true or false, not {_kind(value)}.", param=key)
    return value


def get_str(body: dict, key: str, default: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ApiError(f"'{key}' must be a string, not {_kind(value)}.", param=key)
    return value


def get_stop(body: dict, key: str) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        if len(value) > 16:
            raise ApiError(f"'{key}' may hold at most 16 strings, not {len(value)}.", param=key)
        return [v for v in value if v]
    raise ApiError(f"'{key}' must be a string or an array of strings.", param=key)


def get_seed(body: dict) -> int:
    seed = get_int(body, "seed", default=0)
    return seed & 0xFFFFFFFFFFFFFFFF


def get_session_id(body: dict, request: Request) -> str | None:
    """`session_id` (or the X-Session-Id header), checked against the strict id pattern."""
    session = get_str(body, "session_id")
    param = "session_id"
    if not session:
        session, param = request.headers.get("x-session-id"), "X-Session-Id"
    if not session:
        return None
    try:
        return check_session_id(session)
    except ValueError as error:
        raise ApiError(f"'{param}': {error}", param="session_id") from error


# ---------------------------------------------------------------------------------------------
# The plan of one chat turn
# ---------------------------------------------------------------------------------------------

@dataclass
class ChatPlan:
    """One chat turn in API-neutral form (messages in OpenAI chat shape)."""

    messages: list[dict[str, Any]]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str | dict[str, str] = "auto"  # auto | none | required | {"name": ...}
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} / {"type": "json_schema", ...}
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the request's name for it, for error messages
    stop: list[str] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    draft: bool = True
    audit: bool = False
    session_id: str | None = None
    stream: bool = False
    model: str = ""
    raw_prompt: str | list[int] | None = None  # /v1/completions: no chat template


def parse_tool_choice(value: Any, tools: Sequence[ToolSpec], param: str = "tool_choice") -> str | dict[str, str]:
    """OpenAI / Responses / Anthropic tool_choice, normalized to auto|none|required|{"name"}."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value in ("auto", "none", "required"):
            choice = value
        elif value == "any":
            choice = "required"
        else:
            raise ApiError(f"'{param}' must be 'auto', 'none', 'required' or a named function, not {value!r}.",
                           param=param)
    elif isinstance(value, dict):
        kind = value.get("type")
        name = value.get("name") or (value.get("function") or {}).get("name")
        if kind in ("auto", "none"):
            choice = kind
        elif kind in ("any", "required"):
            choice = "required"
        elif kind in ("function", "tool", "custom") and isinstance(name, str) and name:
            choice = {"name": name}
        else:
            raise ApiError(f"'{param}' is not a tool choice this server understands: {json.dumps(value)[:120]}.",
                           param=param)
    else:
        raise ApiError(f"'{param}' must be a string or an object, not {_kind(value)}.", param=param)
    if isinstance(choice, dict) and choice["name"] not in {t.name for t in tools}:
        raise ApiError(f"'{param}' names the tool {choice['name']!r}, which is not among the request's tools.",
                       param=param)
    if choice == "required" and not tools:
        raise ApiError(f"'{param}' is 'required' but the request has no tools.", param=param)
    return choice


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ApiError(f"{where} must be a JSON schema object, not {_kind(schema)}.")
    return schema


def sampling(plan: ChatPlan) -> SamplingParams:
    try:
        return SamplingParams(temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p,
                              min_p=plan.min_p, seed=plan.seed)
    except ValueError as error:
        raise ApiError(str(error)) from error


# ---------------------------------------------------------------------------------------------
# From plan to TurnRequest
# ---------------------------------------------------------------------------------------------

def busy_error(runtime: Runtime) -> ApiError:
    """429 with Retry-After: a rough wait, one round of the active replies per queued group."""
    waiting = runtime.waiting
    retry = 1 + waiting // max(1, runtime.max_active)
    return ApiError(f"The server is busy: {waiting} requests are queued (limit {runtime.max_queue}, "
                    f"--max-queue) behind {runtime.max_active} decoding. Retry after {retry} s.", status=429,
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})


def check_capacity(runtime: Runtime) -> None:
    if runtime.full:
        raise busy_error(runtime)


@dataclass
class Prepared:
    """A plan rendered for the model: the TurnRequest plus how to read the model's output."""

    request: TurnRequest
    tools_enabled: bool
    prefix: str  # output the prompt forced (parsed as if the model wrote it)
    user_stops: list[str]
    prompt_tokens: int


def grammar_for(plan: ChatPlan) -> str | None:
    """The grammar a reply must follow: forced tool calls, JSON output; None when free.

    The engine masks every row with it (serial and verify alike), so even a small model returns
    a well-formed call, and drafting stays exact.
    """
    if plan.tools and (plan.tool_choice == "required" or isinstance(plan.tool_choice, dict)):
        tools = [{"name": t.name, "parameters": t.parameters} for t in plan.tools]
        name = plan.tool_choice["name"] if isinstance(plan.tool_choice, dict) else None
        return tool_call_grammar(tools, name=name, parallel=plan.parallel_tool_calls and name is None)
    fmt = plan.response_format
    if fmt and fmt.get("type") == "json_object":
        return json_object_grammar()
    if fmt and fmt.get("type") == "json_schema":
        return json_schema_grammar((fmt.get("json_schema") or fmt).get("schema") or {"type": "object"})
    return None


def checked_grammar(plan: ChatPlan) -> str | None:
    """`grammar_for(plan)`, compiled once here so a bad schema is a 400 now, not a failed turn later."""
    grammar = grammar_for(plan)
    if grammar is None:
        return None
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        where = "tools" if plan.tools and plan.tool_choice not in ("auto", "none") else "response_format"
        reason = problem.strip().splitlines()[0].split(": ", 1)[-1]
        raise ApiError(f"The JSON schema in '{where}' cannot be used: {reason}. Send a valid JSON schema object.",
                       param=where)
    return grammar


def plan_cuts(runtime: Runtime, messages: list[dict[str, Any]], tools: Sequence[Any] | None,
              prompt: Sequence[int]) -> list[int]:
    """Prefill cuts at each assistant message's start and this reply's, as the chat renders them.

    Prefixes already rendered for an earlier turn of the conversation come from the runtime's memo.
    """
    return message_cuts(
        memo_for(runtime),
        lambda head: runtime.encode(render_chat(runtime.tokenizer, head, tools, add_generation_prompt=False)),
        messages, prompt, tools_salt(tools))


def _instructions(plan: ChatPlan) -> str:
    """The strong instruction for forced calls and JSON output, a user turn after the conversation."""
    return trailing_instruction(plan.tool_choice, plan.response_format)


def prepare(runtime: Runtime, plan: ChatPlan, api: str, request: Request,
            default_max_tokens: int | None = None) -> Prepared:
    """Render, tokenize and size a plan; a prompt that does not fit is a 400 naming the limit.

    A full queue is a 429 here, before any streamed response has sent its 200.
    """
    check_capacity(runtime)
    params = sampling(plan)
    tools_enabled = bool(plan.tools) and plan.tool_choice != "none" and plan.raw_prompt is None
    internal_stops: list[str] = []
    cuts: list[int] = []
    if plan.raw_prompt is not None:
        prefix = ""
        if isinstance(plan.raw_prompt, str):
            prompt = runtime.encode(plan.raw_prompt) if plan.raw_prompt else []
        else:
            prompt = list(plan.raw_prompt)
        if not prompt:
            raise ApiError("'prompt' is empty; send some text.", param="prompt")
    else:
        messages = list(plan.messages)
        note = _instructions(plan)  # after the shared history, outside it: the next turn reuses the cache
        try:
            text = render_chat(runtime.tokenizer, messages, plan.tools or None, trailing=note or None)
        except Exception as error:  # jinja errors of the model's own template
            raise ApiError(f"The model's chat template cannot render these messages: {error}") from error
        prefix = ""
        if tools_enabled and (isinstance(plan.tool_choice, dict) or not plan.parallel_tool_calls):
            internal_stops.append(TOOL_CALL_CLOSE)  # one call wanted: stop as soon as it is written
        if plan.tools and plan.tool_choice == "none":
            internal_stops.append(TOOL_CALL_OPEN)
        prompt = runtime.encode(text)
        cuts = plan_cuts(runtime, messages, plan.tools or None, prompt)
    limit = runtime.context_length
    if len(prompt) >= limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens, but the prompt is {len(prompt)} tokens. "
            "Shorten the messages.", code="context_length_exceeded", param="messages")
    room = limit - len(prompt)
    max_tokens = plan.max_tokens
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens) if default_max_tokens else room
    elif len(prompt) + max_tokens > limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the completion). "
            f"Reduce the length of the messages or '{plan.max_tokens_param}' (at most {room} here).",
            code="context_length_exceeded", param=plan.max_tokens_param)
    config = GenerationConfig(params=params, max_tokens=max_tokens,
                              stop=tuple(dict.fromkeys([*plan.stop, *internal_stops])), draft=plan.draft,
                              grammar=checked_grammar(plan) if plan.raw_prompt is None else None)
    turn_request = TurnRequest(
        prompt=prompt, config=config, api=api, client=request.headers.get("user-agent", ""),
        session_id=plan.session_id, audit=plan.audit, model=plan.model,
        cuts=cuts, outcome_follows=True,
        meta={"prefix": prefix, "tools": [t.name for t in plan.tools], "stream": plan.stream},
    )
    return Prepared(turn_request, tools_enabled, prefix, list(plan.stop), len(prompt))


# ---------------------------------------------------------------------------------------------
# Running a turn
# ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How a turn ended, in API-neutral terms."""

    turn: Turn
    completion: Completion
    content: str
    calls: list[ToolCall]
    finish: str  # stop | length | tool_calls
    stop_sequence: str | None
    timings: dict[str, Any]
    agentfold: dict[str, Any]

    @property
    def prompt_tokens(self) -> int:
        return self.completion.stats.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.completion.stats.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.completion.stats.completion_tokens


async def _watch_disconnect(request: Request, turn: Turn) -> None:
    """Cancel the turn as soon as the client goes away (the body was already read)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                turn.cancel()
                return
    except Exception:  # receive() after the response finished, or a server shutting down
        return


async def drive(runtime: Runtime, prepared: Prepared, request: Request) -> AsyncIterator[TextPiece | ToolCall | Outcome]:
    """Submit a prepared turn; yield content text and tool calls as they settle, then the Outcome.

    Whatever way the consumer stops early (client gone, task cancelled), the turn is cancelled,
    so the worker drops it before its next verify pass.
    """
    try:
        turn = runtime.submit(prepared.request)
    except RuntimeBusy as error:
        raise busy_error(runtime) from error
    except RuntimeError as error:
        raise ApiError(str(error), status=503, type="server_error") from error
    watcher = asyncio.create_task(_watch_disconnect(request, turn))
    parser = ToolCallParser(prepared.tools_enabled, prepared.prefix)
    done = False
    try:
        async for event in _events(turn):
            if isinstance(event, Delta):
                for piece in parser.feed(event.text):
                    yield piece
                continue
            for piece in parser.finish():
                yield piece
            done = True
            yield _outcome(runtime, prepared, turn, event, parser)
            return
    finally:
        watcher.cancel()
        if not done:
            turn.cancel()
            if turn.completion is not None:  # finished as the client left: its row is still written
                report_outcome(runtime, turn, turn.completion.finish_reason, 0)


async def _events(turn: Turn) -> AsyncIterator[Delta | Completion]:
    """The turn's events; a runtime shutting down is a 503, not a 500."""
    try:
        async for event in turn.events():
            yield event
    except RuntimeClosed as error:
        raise ApiError(f"The server is shutting down: {error}", status=503, type="server_error") from error


def report_outcome(runtime: Runtime, turn: Turn, finish: str, tool_calls: int) -> None:
    """The API-level outcome to the `after_response` hook (the turn's one telemetry write)."""
    turn.finish_reason, turn.tool_calls = finish, tool_calls
    if runtime.after_response is not None:
        try:
            runtime.after_response(turn)
        except Exception:  # telemetry must never cost the client its reply
            log.exception("after_response hook failed for %s", turn.id)


def _outcome(runtime: Runtime, prepared: Prepared, turn: Turn, completion: Completion,
             parser: ToolCallParser) -> Outcome:
    stop_sequence = None
    if completion.finish_reason == "stop" and prepared.user_stops and completion.tokens and \
            completion.tokens[-1] not in runtime.engine.eos_token_ids:
        full = runtime.tokenizer.decode(completion.tokens, skip_special_tokens=True)
        rest = full[len(completion.text):] if full.startswith(completion.text) else full
        hits = [s for s in prepared.user_stops if rest.startswith(s)] or [s for s in prepared.user_stops if s in rest]
        stop_sequence = max(hits, key=len) if hits else None
    finish = "tool_calls" if parser.calls else completion.finish_reason
    report_outcome(runtime, turn, finish, len(parser.calls))
    timings, block = turn_blocks(turn, runtime)
    return Outcome(turn, completion, parser.content, list(parser.calls), finish, stop_sequence, timings, block)


async def collect(runtime: Runtime, prepared: Prepared, request: Request) -> Outcome:
    """Run a turn to the end (non-streaming responses)."""
    async for item in drive(runtime, prepared, request):
        if isinstance(item, Outcome):
            return item
    raise ApiError("the turn ended without a result", status=500, type="server_error")


# ---------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------

def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event (`event:` line only for APIs that name their events)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else dumps(data)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def now() -> int:
    return int(time.time())
