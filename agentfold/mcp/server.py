"""MCP server (DESIGN contract 4): generate, check exactness, audit, read telemetry, manage sessions.

Built with the official `mcp` SDK (2.x, `MCPServer`) around one `Service`, so a turn generated over
MCP goes through exactly the path an HTTP turn takes: the same runtime queue, the same session
restore and snapshots, the same telemetry row (api="mcp") and the same audits. Tools return
pydantic models, so every result carries an `output_schema` and `structured_content` that agents
can read without parsing text.

Why these choices:

- Bad input is a tool error (`is_error=True` with a message), never a crash: argument limits are
  in the input schema (pydantic `Field` constraints, which the SDK reports as validation errors),
  and what only the service can tell (unknown ids, a prompt longer than the context) becomes a
  `ToolError` with a readable message.
- Telemetry rows are returned without `inputs` (the prompt and reply ids an audit replays) and
  `emit_ms` (one timestamp per token): both grow with the conversation and would flood an agent's
  context; `get_turn` and the `agentfold://turns/{id}` resource give everything else.
- Blocking work (SQLite reads, the telemetry writer's flush, snapshot deletion) runs in a worker
  thread, so a slow disk never stalls the event loop that streams other clients' tokens.
- Reads flush the telemetry writer first: a turn an agent just generated is visible at once.

`mount_mcp(service)` gives the routes and lifespan that serve the same tools at `/mcp` on the
HTTP server (streamable HTTP, DNS-rebinding protection on for loopback); `agentfold mcp` serves
them over stdio (see `agentfold.cli.ops`).
"""

from __future__ import annotations

import functools
import json
import logging
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar

import anyio.to_thread
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, TransportSecuritySettings
from mcp.types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from agentfold.chat.template import render_chat
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.sampler import SamplingParams
from agentfold.http.auth import KEY_HINT, ApiKey
from agentfold.http.common import plan_cuts, report_outcome
from agentfold.http.report import turn_record
from agentfold.serve.limits import is_loopback
from agentfold.serve.scheduler import RuntimeBusy, RuntimeClosed, TurnRequest
from agentfold.serve.service import Service
from agentfold.serve.telemetry import TurnRecord
from agentfold.sessions.ids import check_session_id

log = logging.getLogger(__name__)

T = TypeVar("T")

# Telemetry fields left out of tool results: both grow with the turn (see the module docstring).
HIDDEN_TURN_FIELDS = ("inputs", "emit_ms")
DEFAULT_MAX_TOKENS = 256
MAX_LIST = 1000

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)


# ---------------------------------------------------------------------------------------------
# Input and output models
# ---------------------------------------------------------------------------------------------

class ChatMessage(BaseModel):
    """One chat message (OpenAI chat shape, text only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str


def _turn_row_model() -> type[BaseModel]:
    """`TurnRow`: a TurnRecord without its bulky fields, built from the dataclass so it never drifts."""
    hints = typing.get_type_hints(TurnRecord)
    fields: dict[str, Any] = {name: (hint, ...) for name, hint in hints.items() if name not in HIDDEN_TURN_FIELDS}
    return create_model("TurnRow", __config__=ConfigDict(extra="ignore"),
                        __doc__="One turn's telemetry row (DESIGN contract 3), without inputs and emit_ms.",
                        **fields)


TurnRow = _turn_row_model()


class GenerateResult(BaseModel):
    """A generated reply and what it cost (the turn's telemetry row has the rest)."""

    text: str
    finish_reason: str
    token_sha: str = Field(description="sha256 of the emitted token ids; equal hashes mean equal replies")
    turn_id: str
    session_id: str | None
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens restored from a session snapshot, not prefilled")
    completion_tokens: int
    draft_method: str
    verify_passes: int
    drafted: int
    accepted: int
    decode_tps: float
    ttft_ms: float
    prefill_ms: float
    total_ms: float
    audit: str = Field(description="skipped | passed | failed (inline audit when audit=true)")
    mismatch_position: int | None


class ExactnessRun(BaseModel):
    """One side of an exactness check."""

    tokens: int
    token_sha: str
    decode_tps: float
    total_ms: float
    ttft_ms: float
    verify_passes: int
    drafted: int
    accepted: int


class ExactnessResult(BaseModel):
    """Drafted against serial decoding of the same prompt and sampling."""

    equal: bool
    mismatch_position: int | None = Field(description="index of the first differing token, None when equal")
    drafted: ExactnessRun
    serial: ExactnessRun


class AuditResult(BaseModel):
    """A stored turn replayed serially from an empty cache."""

    turn_id: str
    verdict: Literal["passed", "failed"]
    mismatch_position: int | None
    token_sha: str = Field(description="hash of the reply the turn sent")
    audit_token_sha: str = Field(description="hash of the serial replay")


class TurnList(BaseModel):
    count: int
    turns: list[TurnRow]  # type: ignore[valid-type]


class LatencySummary(BaseModel):
    """Latency and efficiency over recent turns (TelemetryStore.latency_summary); times in ms."""

    turns: int
    errors: int
    window_seconds: float | None
    last_n: int | None
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    decode_tps: float | None
    tokens_per_pass: float | None
    acceptance_rate: float | None
    cache_hit_share: float | None
    audits_passed: int
    audits_failed: int


class SessionRow(BaseModel):
    """A stored conversation: its turn count and the bytes of the snapshots its turns name."""

    model_config = ConfigDict(extra="ignore")

    id: str
    title: str | None = None
    created: float
    last_used: float
    pinned: bool
    parent: str | None = None
    turns: int = 0
    bytes: int = 0


class SessionTurn(BaseModel):
    """One turn in the session index (the snapshot it left for the next turn)."""

    model_config = ConfigDict(extra="ignore")

    index: int
    prompt_tokens: int
    reply_tokens: int
    snapshot_id: str | None = None
    created: float


class SessionList(BaseModel):
    count: int
    sessions: list[SessionRow]


class SessionDetail(BaseModel):
    session: SessionRow
    turns: list[SessionTurn]
    telemetry: list[TurnRow] = Field(description="this session's telemetry rows, newest first")  # type: ignore[valid-type]


class ForkResult(BaseModel):
    session_id: str = Field(description="the new session")
    parent: str
    turns: int = Field(description="turns the new session starts with")


class PinResult(BaseModel):
    session_id: str
    pinned: bool


class DeleteResult(BaseModel):
    session_id: str
    deleted: bool
    removed_snapshots: list[str] = Field(description="snapshot ids no other session used, now deleted")


class SnapshotRow(BaseModel):
    """A stored KV snapshot: its length, size, and the prefill boundaries that built it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    token_count: int
    bytes: int
    parent: str | None = None
    pinned: bool
    hits: int = 0
    created: float
    last_used: float
    boundaries: list[int]
    key: str = Field(description="snapshot key: model, tokenizer, template, layout and plan fingerprint")


class SnapshotList(BaseModel):
    count: int
    total_bytes: int
    snapshots: list[SnapshotRow]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

async def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run SQLite / disk work off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _message(error: BaseException) -> str:
    """The text of a service error (KeyError's str() adds quotes)."""
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def turn_row(row: dict[str, Any]) -> dict[str, Any]:
    """A telemetry row without the fields that grow with the turn."""
    return {k: v for k, v in row.items() if k not in HIDDEN_TURN_FIELDS}


def _client_name(ctx: Context) -> str:
    """The MCP client's name/version for the telemetry `client` column ("mcp" when it sent none)."""
    try:
        params = ctx.session.client_params
        info = params.client_info if params is not None else None
        if info is not None:
            return f"{info.name}/{info.version}" if info.version else info.name
    except Exception:  # noqa: BLE001  (no session info on this transport: not worth failing a turn)
        pass
    try:
        headers = ctx.headers
    except Exception:  # noqa: BLE001
        headers = None
    return headers.get("user-agent", "mcp") if headers else "mcp"


def _prompt(service: Service, messages: Sequence[ChatMessage] | None, prompt: str | None) -> tuple[list[int], list[int]]:
    """Prompt ids and prefill cuts for exactly one of `messages` (chat template) or `prompt` (raw text).

    Cuts follow the HTTP chat path (agentfold.http.common.plan_cuts), so a session resumed over
    MCP restores the same snapshots, and gives the same bytes, as one resumed over HTTP.
    """
    if (messages is None) == (prompt is None):
        raise ToolError("Give exactly one of 'messages' (a chat, rendered with the model's template) "
                        "or 'prompt' (raw text).")
    runtime = service.runtime
    if prompt is not None:
        if not prompt:
            raise ToolError("'prompt' is empty; send some text.")
        return runtime.encode(prompt), []
    assert messages is not None
    if not messages:
        raise ToolError("'messages' is empty; send at least one message.")
    chat = [m.model_dump() for m in messages]
    try:
        ids = runtime.encode(render_chat(runtime.tokenizer, chat))
    except Exception as error:  # jinja errors of the model's own template
        raise ToolError(f"The model's chat template cannot render these messages: {error}") from error
    return ids, plan_cuts(runtime, chat, None, ids)


def _config(service: Service, prompt: list[int], max_tokens: int, temperature: float, seed: int,
            draft: bool) -> GenerationConfig:
    limit = service.runtime.context_length
    if len(prompt) + max_tokens > limit:
        raise ToolError(f"The model's context is {limit} tokens: the prompt has {len(prompt)}, so 'max_tokens' "
                        f"may be at most {max(0, limit - len(prompt))} (asked {max_tokens}).")
    try:
        params = SamplingParams(temperature=temperature, seed=seed & 0xFFFFFFFFFFFFFFFF)
        return GenerationConfig(params=params, max_tokens=max_tokens, draft=draft)
    except ValueError as error:
        raise ToolError(str(error)) from error


def _session_id(session_id: str | None) -> str | None:
    """A session id from a tool argument, checked against the strict pattern (ToolError if not)."""
    if session_id is None:
        return None
    try:
        return check_session_id(session_id)
    except ValueError as error:
        raise ToolError(f"'session_id': {error}") from error


def _not_taken(error: RuntimeError) -> ToolError:
    """A turn the runtime did not take: shutting down, or its queue is full."""
    if isinstance(error, RuntimeBusy):
        return ToolError(f"The server is busy ({error}); retry in a few seconds.")
    return ToolError(f"The server is shutting down: {error}")


def _session_row(service: Service, session_id: str) -> dict[str, Any]:
    _session_id(session_id)
    manager = _sessions(service)
    row = next((s for s in manager.list_sessions() if s["id"] == session_id), None)
    if row is None:
        raise KeyError(f"no session {session_id!r}")
    return row


def _sessions(service: Service) -> Any:
    if service.sessions is None:
        raise ToolError("Sessions are off on this server (started with --no-sessions).")
    return service.sessions


def _snapshot(row: dict[str, Any]) -> dict[str, Any]:
    boundaries = row.get("boundaries")
    return {**row, "boundaries": json.loads(boundaries) if isinstance(boundaries, str) else (boundaries or [])}


def _session_detail(service: Service, session_id: str, limit: int = 20) -> dict[str, Any]:
    """A session's row, its index turns and its telemetry rows (caller runs it in a thread)."""
    manager = _sessions(service)
    row = _session_row(service, session_id)
    service.telemetry.flush(timeout=30)
    telemetry = [turn_row(r) for r in service.telemetry.list_turns(session_id=session_id, limit=limit)]
    return {"session": row, "turns": manager.turns(session_id), "telemetry": telemetry}


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

def build_mcp(service: Service, name: str = "agentfold") -> MCPServer:
    """The MCP server for one service: tools, and JSON resources for sessions and turns."""
    runtime = service.runtime
    mcp = MCPServer(
        name, version=_version(),
        instructions=(f"Local model {runtime.model_id} with exact speculative decoding. `generate` replies "
                      "(within a session if you pass session_id); `check_exactness` compares drafted with "
                      "serial decoding; `audit_turn` replays a past turn; turn telemetry, latency summaries "
                      "and session management are here too."),
    )

    # -- generation -------------------------------------------------------------------------------
    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    async def generate(
        ctx: Context,
        messages: Annotated[list[ChatMessage] | None, Field(
            description="the conversation, rendered with the model's chat template (give this or prompt)")] = None,
        prompt: Annotated[str | None, Field(description="raw text, no chat template (give this or messages)")] = None,
        session_id: Annotated[str | None, Field(
            description="resume this session's stored cache (created if new); none: a new session")] = None,
        max_tokens: Annotated[int, Field(ge=1, description="reply budget in tokens")] = DEFAULT_MAX_TOKENS,
        temperature: Annotated[float, Field(ge=0.0, le=2.0, description="0: greedy")] = 0.0,
        seed: Annotated[int, Field(description="sampling seed (matters when temperature > 0)")] = 0,
        draft: Annotated[bool, Field(description="speculative drafting; the reply is the same either way")] = True,
        audit: Annotated[bool, Field(description="replay serially right after and compare (slower)")] = False,
    ) -> GenerateResult:
        """Generate a reply with the local model, through the same queue, sessions and telemetry as HTTP.

        Progress notifications report committed tokens (of max_tokens) while it decodes.
        """
        session_id = _session_id(session_id)
        ids, cuts = _prompt(service, messages, prompt)
        config = _config(service, ids, max_tokens, temperature, seed, draft)
        request = TurnRequest(prompt=ids, config=config, api="mcp", client=_client_name(ctx),
                              session_id=session_id, audit=audit, cuts=tuple(cuts), model=runtime.model_id,
                              outcome_follows=True)

        async def on_tokens(count: int) -> None:
            await ctx.report_progress(count, total=max_tokens)

        try:
            completion, turn = await service.run_turn(request, on_tokens)
        except (RuntimeBusy, RuntimeClosed) as error:
            raise _not_taken(error) from error
        report_outcome(runtime, turn, completion.finish_reason, 0)  # its telemetry row, sampled audits
        record = turn_record(turn, runtime)
        return GenerateResult(
            text=completion.text, finish_reason=completion.finish_reason, token_sha=completion.token_sha,
            turn_id=record.turn_id, session_id=record.session_id, prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
            draft_method=record.draft_method, verify_passes=record.verify_passes, drafted=record.drafted,
            accepted=record.accepted, decode_tps=round(record.decode_tps, 3), ttft_ms=round(record.ttft_ms, 3),
            prefill_ms=round(record.prefill_ms, 3), total_ms=round(record.total_ms, 3), audit=turn.audit,
            mismatch_position=turn.mismatch_position)

    @mcp.tool(annotations=READ_ONLY)
    async def check_exactness(
        messages: Annotated[list[ChatMessage] | None, Field(description="a chat (give this or prompt)")] = None,
        prompt: Annotated[str | None, Field(description="raw text (give this or messages)")] = None,
        max_tokens: Annotated[int, Field(ge=1, description="tokens to compare")] = 64,
        temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0,
        seed: int = 0,
    ) -> ExactnessResult:
        """Decode the same prompt with drafting and serially (no session cache) and compare the token ids.

        Exact speculative decoding promises equal replies; this shows it on your prompt, with both
        timings, and where they part if they ever do.
        """
        ids, _ = _prompt(service, messages, prompt)
        config = _config(service, ids, max_tokens, temperature, seed, draft=True)
        try:
            result = await service.check_exactness(ids, config)
        except (RuntimeBusy, RuntimeClosed) as error:
            raise _not_taken(error) from error
        return ExactnessResult.model_validate(result)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                          open_world_hint=False))
    async def audit_turn(turn_id: str) -> AuditResult:
        """Replay a stored turn serially from an empty cache and compare its tokens; the verdict is stored."""
        await _blocking(service.telemetry.flush, 30)
        try:
            result = await service.audit_turn(turn_id)
        except (KeyError, ValueError) as error:
            raise ToolError(_message(error)) from error
        except (RuntimeBusy, RuntimeClosed) as error:
            raise _not_taken(error) from error
        return AuditResult.model_validate(result)

    # -- telemetry --------------------------------------------------------------------------------
    @mcp.tool(annotations=READ_ONLY)
    async def get_turn(turn_id: str) -> TurnRow:  # type: ignore[valid-type]
        """One turn's telemetry row: tokens, cache, timings, drafting and audit (DESIGN contract 3)."""
        row = await _blocking(_read_turn, service, turn_id)
        if row is None:
            raise ToolError(f"no turn {turn_id!r}; list_turns shows the recent ones")
        return TurnRow.model_validate(turn_row(row))

    @mcp.tool(annotations=READ_ONLY)
    async def list_turns(
        session_id: Annotated[str | None, Field(description="only this session's turns")] = None,
        since: Annotated[float | None, Field(description="only turns started at or after (Unix seconds)")] = None,
        limit: Annotated[int, Field(ge=1, le=MAX_LIST)] = 20,
    ) -> TurnList:
        """Recent turns' telemetry rows, newest first."""
        _session_id(session_id)

        def read() -> list[dict[str, Any]]:
            service.telemetry.flush(timeout=30)
            return service.telemetry.list_turns(session_id=session_id, since=since, limit=limit)

        rows = [turn_row(r) for r in await _blocking(read)]
        return TurnList(count=len(rows), turns=rows)

    @mcp.tool(annotations=READ_ONLY)
    async def latency_summary(
        window_seconds: Annotated[float | None, Field(gt=0, description="turns of the last N seconds")] = None,
        last_n: Annotated[int | None, Field(ge=1, description="the last N turns")] = None,
    ) -> LatencySummary:
        """TTFT and inter-token latency percentiles, decode rate, drafting and cache efficiency, audits."""

        def read() -> dict[str, Any]:
            service.telemetry.flush(timeout=30)
            return service.telemetry.latency_summary(window_seconds=window_seconds, last_n=last_n)

        return LatencySummary.model_validate(await _blocking(read))

    # -- sessions ---------------------------------------------------------------------------------
    @mcp.tool(annotations=READ_ONLY)
    async def list_sessions() -> SessionList:
        """Stored sessions, most recently used first."""
        rows = await _blocking(lambda: _sessions(service).list_sessions())
        return SessionList(count=len(rows), sessions=rows)

    @mcp.tool(annotations=READ_ONLY)
    async def get_session(session_id: str) -> SessionDetail:
        """A session: its row, its turns in the session index, and its telemetry rows."""
        try:
            return SessionDetail.model_validate(await _blocking(_session_detail, service, session_id))
        except KeyError as error:
            raise ToolError(_message(error) + "; list_sessions shows the stored ones.") from error

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    async def fork_session(session_id: str, turn: Annotated[int, Field(ge=0, description="last turn kept (0-based)")]
                           ) -> ForkResult:
        """A new session holding turns 0..turn of a session; both continue independently from there."""

        def fork() -> str:
            _session_row(service, session_id)
            return _sessions(service).fork(session_id, turn)

        try:
            forked = await _blocking(fork)
        except (KeyError, ValueError) as error:
            raise ToolError(_message(error)) from error
        return ForkResult(session_id=forked, parent=session_id, turns=turn + 1)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                                          open_world_hint=False))
    async def pin_session(session_id: str, pinned: bool = True) -> PinResult:
        """Pin (or unpin) a session: a pinned session's snapshots are never evicted."""

        def pin() -> None:
            _session_row(service, session_id)
            _sessions(service).pin(session_id, pinned)

        try:
            await _blocking(pin)
        except KeyError as error:
            raise ToolError(_message(error)) from error
        return PinResult(session_id=session_id, pinned=pinned)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                                          open_world_hint=False))
    async def delete_session(session_id: str) -> DeleteResult:
        """Delete a session, its turns, and the snapshots no other session uses (pinned ones stay)."""

        def delete() -> list[str]:
            _session_row(service, session_id)
            return _sessions(service).delete(session_id)

        try:
            removed = await _blocking(delete)
        except KeyError as error:
            raise ToolError(_message(error)) from error
        return DeleteResult(session_id=session_id, deleted=True, removed_snapshots=removed)

    @mcp.tool(annotations=READ_ONLY)
    async def list_snapshots() -> SnapshotList:
        """Stored KV snapshots, most recently used first, with their size and length."""
        rows = [_snapshot(r) for r in await _blocking(lambda: _sessions(service).list_snapshots())]
        return SnapshotList(count=len(rows), total_bytes=sum(r["bytes"] for r in rows), snapshots=rows)

    # -- resources ----------------------------------------------------------------------------------
    @mcp.resource("agentfold://sessions/{session_id}", name="session", mime_type="application/json",
                  description="A session: its row, index turns and telemetry rows (JSON).")
    async def session_resource(session_id: str) -> str:
        try:
            detail = await _blocking(_session_detail, service, session_id)
        except KeyError as error:
            raise ResourceNotFoundError(_message(error)) from error
        except ToolError as error:
            raise ResourceNotFoundError(str(error)) from error
        return SessionDetail.model_validate(detail).model_dump_json()

    @mcp.resource("agentfold://turns/{turn_id}", name="turn", mime_type="application/json",
                  description="One turn's telemetry row (JSON, without inputs and emit_ms).")
    async def turn_resource(turn_id: str) -> str:
        row = await _blocking(_read_turn, service, turn_id)
        if row is None:
            raise ResourceNotFoundError(f"no turn {turn_id!r}")
        return TurnRow.model_validate(turn_row(row)).model_dump_json()

    return mcp


def _read_turn(service: Service, turn_id: str) -> dict[str, Any] | None:
    service.telemetry.flush(timeout=30)
    return service.telemetry.get_turn(turn_id)


def _version() -> str:
    import agentfold

    return agentfold.__version__


# ---------------------------------------------------------------------------------------------
# Serving over HTTP
# ---------------------------------------------------------------------------------------------

class _RequireKey:
    """ASGI wrapper: with an API key set, MCP requests must carry it like the HTTP APIs' requests.

    (`create_app`'s guard checks it too; this keeps /mcp closed on any app it is mounted on.)
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = ApiKey(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if not self.key.matches(Headers(scope=scope)):
                response = JSONResponse({"error": {"message": f"Invalid or missing API key: {KEY_HINT}.",
                                                   "type": "authentication_error", "code": "invalid_api_key",
                                                   "param": None}}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def mount_mcp(service: Service, api_key: str | None = None, host: str = "127.0.0.1", path: str = "/mcp",
              mcp: MCPServer | None = None, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
              cors_origins: Sequence[str] = ()) -> tuple[list[BaseRoute], Callable[[Any], Any]]:
    """Routes and lifespan that serve the MCP tools at `path` (streamable HTTP) on the HTTP app.

    Pass them to `create_app(runtime, extra_routes=routes, lifespan=lifespan)`. The lifespan runs
    the SDK's session manager (a mounted sub-app's own lifespan would never run). The route is
    the SDK's own `/mcp` endpoint, not a catch-all `Mount("/")`, so other paths keep the HTTP
    app's 404s. `host` is where the server listens: on a loopback address the SDK's DNS-rebinding
    protection is on (other Host headers get 421); on a public one it is off, as the SDK does.
    With `api_key`, MCP requests need it too (x-api-key or Bearer), like the HTTP APIs. Bodies over
    `max_body_bytes` get the SDK's 413; `cors_origins` are allowed origins besides loopback.
    """
    server = mcp or build_mcp(service)
    security = None
    if is_loopback(host):  # the SDK's own rule knows only the three usual spellings of loopback
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1", "127.0.0.1:*", "localhost", "localhost:*", "[::1]", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*", *cors_origins])
    app = server.streamable_http_app(streamable_http_path=path, host=host, transport_security=security,
                                     max_request_body_size=max_body_bytes)
    routes: list[BaseRoute] = []
    for route in app.routes:
        if api_key and isinstance(route, Route) and route.path == path:
            route = Route(path, endpoint=_RequireKey(route.app, api_key))
        routes.append(route)

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        async with server.session_manager.run():
            yield

    return routes, lifespan
