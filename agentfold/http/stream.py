"""Running one chat turn for an HTTP request: prepare, drive, collect, and the SSE framing.

`prepare` turns a `ChatPlan` into a `PreparedTurn` (agentfold.serve.chat_turn) after checking
the queue, so a full server is a 429 before any streamed response has sent its 200. `drive` runs
it on the runtime and yields content text, reasoning text (a harmony model's analysis channel:
`chat.harmony`), tool calls and finally an `Outcome`; `collect` waits for the Outcome alone. The
API modules only translate those into their own events. A client that goes away cancels its
turn, so the worker drops it before its next verify pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from agentfold.chat.harmony import ReasoningPiece, reasoning_tokens
from agentfold.chat.plan import ChatPlan
from agentfold.chat.tool_calls import TextPiece, reply_parser
from agentfold.chat.tools import ToolCall
from agentfold.engine.decode import Completion, Delta
from agentfold.http.errors import ApiError
from agentfold.serve.chat_turn import PreparedTurn, prepare_turn
from agentfold.serve.report import report_outcome, turn_blocks
from agentfold.serve.scheduler import Runtime, RuntimeBusy, RuntimeClosed, Turn

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def new_id(prefix: str) -> str:
    """A response / item / call id: `prefix` and 24 random hex digits."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    """Unix seconds, for `created` fields."""
    return int(time.time())


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event (`event:` line only for APIs that name their events)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else dumps(data)}\n\n"


# ---------------------------------------------------------------------------------------------
# From plan to a prepared turn
# ---------------------------------------------------------------------------------------------

def busy_error(runtime: Runtime) -> ApiError:
    """429 with Retry-After: a rough wait, one round of the active replies per queued group."""
    waiting = runtime.waiting
    retry = 1 + waiting // max(1, runtime.max_active)
    return ApiError(f"The server is busy: {waiting} requests are queued (limit {runtime.max_queue}, "
                    f"--max-queue) behind {runtime.max_active} decoding. Retry after {retry} s.", status=429,
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})


def check_capacity(runtime: Runtime) -> None:
    """A 429 now when the runtime's queue is full."""
    if runtime.full:
        raise busy_error(runtime)


def prepare(runtime: Runtime, plan: ChatPlan, api: str, request: Request,
            default_max_tokens: int | None = None) -> PreparedTurn:
    """Render, tokenize and size a plan for `api`; a full queue is a 429 here, before any 200 is sent.

    A plan the client must fix raises `PlanError` (the app answers it as a 400).
    """
    check_capacity(runtime)
    return prepare_turn(runtime, plan, api, client=request.headers.get("user-agent", ""),
                        default_max_tokens=default_max_tokens)


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
    reasoning: str = ""  # a harmony reply's analysis text (the APIs' reasoning fields); "" for other models
    reasoning_tokens: int = 0  # the reply's tokens that wrote it
    blocks: list[ReasoningPiece | TextPiece | ToolCall] | None = None  # a harmony reply in order; None otherwise

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


async def drive(runtime: Runtime, prepared: PreparedTurn, request: Request
                ) -> AsyncIterator[TextPiece | ReasoningPiece | ToolCall | Delta | Heartbeat | Outcome]:
    """Submit a prepared turn; yield content text, reasoning text (harmony replies only) and tool
    calls as they settle, then the Outcome (and a Heartbeat whenever the turn is silent for
    HEARTBEAT_S, for streams to keep alive).

    A turn whose config asks for logprobs (only Chat Completions / Completions set it) also gets
    each Delta that carries them, ahead of that delta's text.

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
    parser = reply_parser(prepared.harmony, prepared.tools_enabled, prepared.prefix, prepared.tools,
                          None if prepared.parallel else 1)
    done = False
    try:
        async for event in _events(turn):
            if isinstance(event, Heartbeat):
                yield event
                continue
            if isinstance(event, Delta):
                if event.logprobs:  # only turns that asked for logprobs (config.logprobs) carry them
                    yield event
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


@dataclass
class Heartbeat:
    """Nothing was committed for HEARTBEAT_S seconds (a long prefill): a streaming API sends its
    keep-alive (Anthropic `ping`, an SSE comment, Responses `response.in_progress`), so a client
    that drops a silent stream (Claude Code after 300 s, then retrying from scratch) keeps waiting."""


HEARTBEAT_S = 10.0
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients' parsers skip it, their idle timers see bytes


async def _events(turn: Turn) -> AsyncIterator[Delta | Completion | Heartbeat]:
    """The turn's events, and a Heartbeat after every HEARTBEAT_S seconds without one; a runtime
    shutting down is a 503, not a 500."""
    events = turn.events()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=HEARTBEAT_S)  # (waiting never cancels the turn)
            if not done:
                yield Heartbeat()
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    except RuntimeClosed as error:
        raise ApiError(f"The server is shutting down: {error}", status=503, type="server_error") from error
    finally:
        if pending is not None and not pending.done():  # the consumer left: stop the wait (the turn cancels)
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        await events.aclose()


def _outcome(runtime: Runtime, prepared: PreparedTurn, turn: Turn, completion: Completion, parser: Any) -> Outcome:
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
    outcome = Outcome(turn, completion, parser.content, list(parser.calls), finish, stop_sequence, timings, block)
    if prepared.harmony:
        outcome.reasoning, outcome.blocks = parser.reasoning, list(parser.blocks)
        outcome.reasoning_tokens = reasoning_tokens(runtime.engine.tokenizer, completion.tokens,
                                                    runtime.engine.eos_token_ids, parser.reasoning_spans)
    return outcome


async def collect(runtime: Runtime, prepared: PreparedTurn, request: Request) -> Outcome:
    """Run a turn to the end (non-streaming responses)."""
    async for item in drive(runtime, prepared, request):
        if isinstance(item, Outcome):
            return item
    raise ApiError("the turn ended without a result", status=500, type="server_error")
