"""The MCP tools and resources over one `Service`: one method each, registered by `build_mcp`.

A turn generated here goes through exactly the path an HTTP turn takes: the same runtime queue,
the same session restore and snapshots (cuts from agentfold.serve.chat_turn.plan_cuts), the same
telemetry row (api="mcp") and the same audits.

- Bad input is a tool error (`is_error=True` with a message), never a crash: argument limits are
  in the input schema (pydantic `Field` constraints; `agentfold.mcp.server.AgentFoldMCP` reports a
  violation, or an argument no tool takes, as one readable line), and what only the service can
  tell (unknown ids, a prompt longer than the context, deleting a pinned session without `force`)
  becomes a `ToolError` with a readable message.
- Blocking work (SQLite reads, the telemetry writer's flush, snapshot deletion) runs in a worker
  thread, so a slow disk never stalls the event loop that streams other clients' tokens.
- Reads flush the telemetry writer first: a turn an agent just generated is visible at once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

import anyio.to_thread
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from pydantic import BaseModel, Field

from agentfold.chat.template import render_chat
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.sampler import SamplingParams
from agentfold.mcp.results import (
    AuditResult,
    DeleteResult,
    ExactnessResult,
    ForkResult,
    GenerateResult,
    LatencySummary,
    PinResult,
    SessionDetail,
    SessionList,
    SnapshotList,
    TurnList,
    TurnRow,
    turn_row,
)
from agentfold.serve.chat_turn import plan_cuts
from agentfold.serve.report import report_outcome, turn_record
from agentfold.serve.scheduler import RuntimeBusy, RuntimeClosed, TurnRequest
from agentfold.serve.service import Service
from agentfold.sessions.ids import check_session_id

T = TypeVar("T")

DEFAULT_MAX_TOKENS = 256
MAX_LIST = 1000


class ChatMessage(BaseModel):
    """One chat message (OpenAI chat shape, text only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str


class ServiceTools:
    """The tools (and resource readers) of one service; each public method is one MCP tool."""

    def __init__(self, service: Service) -> None:
        self.service = service

    # -- generation -------------------------------------------------------------------------------
    async def generate(
        self,
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
        service, runtime = self.service, self.service.runtime
        session_id = _session_id(session_id)
        ids, (cuts, head) = _prompt(service, messages, prompt)
        config = _config(service, ids, max_tokens, temperature, seed, draft)
        request = TurnRequest(prompt=ids, config=config, api="mcp", client=_client_name(ctx),
                              session_id=session_id, audit=audit, cuts=tuple(cuts), head=head, model=runtime.model_id,
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

    async def check_exactness(
        self,
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
        ids, _ = _prompt(self.service, messages, prompt)
        config = _config(self.service, ids, max_tokens, temperature, seed, draft=True)
        try:
            result = await self.service.check_exactness(ids, config)
        except (RuntimeBusy, RuntimeClosed) as error:
            raise _not_taken(error) from error
        return ExactnessResult.model_validate(result)

    async def audit_turn(self, turn_id: str) -> AuditResult:
        """Replay a stored turn serially from an empty cache and compare its tokens; the verdict is stored."""
        await _blocking(self.service.telemetry.flush, 30)
        try:
            result = await self.service.audit_turn(turn_id)
        except (KeyError, ValueError) as error:
            raise ToolError(_message(error)) from error
        except (RuntimeBusy, RuntimeClosed) as error:
            raise _not_taken(error) from error
        return AuditResult.model_validate(result)

    # -- telemetry --------------------------------------------------------------------------------
    async def get_turn(self, turn_id: str) -> TurnRow:  # type: ignore[valid-type]
        """One turn's telemetry row: tokens, cache, timings, drafting and audit (DESIGN contract 3)."""
        row = await _blocking(_read_turn, self.service, turn_id)
        if row is None:
            raise ToolError(f"no turn {turn_id!r}; list_turns shows the recent ones")
        return TurnRow.model_validate(turn_row(row))

    async def list_turns(
        self,
        session_id: Annotated[str | None, Field(description="only this session's turns")] = None,
        since: Annotated[float | None, Field(description="only turns started at or after (Unix seconds)")] = None,
        limit: Annotated[int, Field(ge=1, le=MAX_LIST)] = 20,
    ) -> TurnList:
        """Recent turns' telemetry rows, newest first."""
        _session_id(session_id)
        telemetry = self.service.telemetry

        def read() -> list[dict[str, Any]]:
            telemetry.flush(timeout=30)
            return telemetry.list_turns(session_id=session_id, since=since, limit=limit)

        rows = [turn_row(r) for r in await _blocking(read)]
        return TurnList(count=len(rows), turns=rows)

    async def latency_summary(
        self,
        window_seconds: Annotated[float | None, Field(gt=0, description="turns of the last N seconds")] = None,
        last_n: Annotated[int | None, Field(ge=1, description="the last N turns")] = None,
    ) -> LatencySummary:
        """TTFT and inter-token latency percentiles, decode rate, drafting and cache efficiency, audits."""
        telemetry = self.service.telemetry

        def read() -> dict[str, Any]:
            telemetry.flush(timeout=30)
            return telemetry.latency_summary(window_seconds=window_seconds, last_n=last_n)

        return LatencySummary.model_validate(await _blocking(read))

    # -- sessions ---------------------------------------------------------------------------------
    async def list_sessions(self) -> SessionList:
        """Stored sessions, most recently used first."""
        rows = await _blocking(lambda: _sessions(self.service).list_sessions())
        return SessionList(count=len(rows), sessions=rows)

    async def get_session(self, session_id: str) -> SessionDetail:
        """A session: its row, its turns in the session index, and its telemetry rows."""
        try:
            return SessionDetail.model_validate(await _blocking(_session_detail, self.service, session_id))
        except KeyError as error:
            raise ToolError(_message(error) + "; list_sessions shows the stored ones.") from error

    async def fork_session(self, session_id: str,
                           turn: Annotated[int, Field(ge=0, description="last turn kept (0-based)")]) -> ForkResult:
        """A new session holding turns 0..turn of a session; both continue independently from there."""

        def fork() -> str:
            _session_row(self.service, session_id)
            return _sessions(self.service).fork(session_id, turn)

        try:
            forked = await _blocking(fork)
        except (KeyError, ValueError) as error:
            raise ToolError(_message(error)) from error
        return ForkResult(session_id=forked, parent=session_id, turns=turn + 1)

    async def pin_session(self, session_id: str, pinned: bool = True) -> PinResult:
        """Pin (or unpin) a session: a pinned session's snapshots are never evicted."""

        def pin() -> None:
            _session_row(self.service, session_id)
            _sessions(self.service).pin(session_id, pinned)

        try:
            await _blocking(pin)
        except KeyError as error:
            raise ToolError(_message(error)) from error
        return PinResult(session_id=session_id, pinned=pinned)

    async def delete_session(
        self, session_id: str,
        force: Annotated[bool, Field(description="delete it even if it is pinned")] = False,
    ) -> DeleteResult:
        """Delete a session, its turns, and the snapshots no other session uses.

        A pinned session is kept: deleting one is an error unless force=true (or unpin it first
        with pin_session(pinned=false)). Pinned snapshots are never deleted.
        """

        def delete() -> list[str]:
            row = _session_row(self.service, session_id)
            if row["pinned"] and not force:
                raise ToolError(f"session {session_id!r} is pinned, so it was not deleted; unpin it with "
                                "pin_session(pinned=false) or pass force=true to delete it anyway.")
            return _sessions(self.service).delete(session_id)

        try:
            removed = await _blocking(delete)
        except KeyError as error:
            raise ToolError(_message(error)) from error
        return DeleteResult(session_id=session_id, deleted=True, removed_snapshots=removed)

    async def list_snapshots(
        self,
        session_id: Annotated[str | None, Field(
            description="only the snapshots this session's turns name; none: every stored snapshot")] = None,
    ) -> SnapshotList:
        """Stored KV snapshots, most recently used first, with their size and length."""

        def read() -> list[dict[str, Any]]:
            manager = _sessions(self.service)
            rows = manager.list_snapshots()
            if session_id is None:
                return rows
            _session_row(self.service, session_id)
            named = {t["snapshot_id"] for t in manager.turns(session_id)}
            return [r for r in rows if r["id"] in named]

        try:
            rows = [_snapshot(r) for r in await _blocking(read)]
        except KeyError as error:
            raise ToolError(_message(error) + "; list_sessions shows the stored ones.") from error
        return SnapshotList(count=len(rows), total_bytes=sum(r["bytes"] for r in rows), snapshots=rows)

    # -- resources ----------------------------------------------------------------------------------
    async def session_resource(self, session_id: str) -> str:
        """`agentfold://sessions/{session_id}`: the session's detail as JSON."""
        try:
            detail = await _blocking(_session_detail, self.service, session_id)
        except KeyError as error:
            raise ResourceNotFoundError(_message(error)) from error
        except ToolError as error:
            raise ResourceNotFoundError(str(error)) from error
        return SessionDetail.model_validate(detail).model_dump_json()

    async def turn_resource(self, turn_id: str) -> str:
        """`agentfold://turns/{turn_id}`: one telemetry row as JSON."""
        row = await _blocking(_read_turn, self.service, turn_id)
        if row is None:
            raise ResourceNotFoundError(f"no turn {turn_id!r}")
        return TurnRow.model_validate(turn_row(row)).model_dump_json()


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

async def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run SQLite / disk work off the event loop."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _message(error: BaseException) -> str:
    """The text of a service error (KeyError's str() adds quotes)."""
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


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


def _prompt(service: Service, messages: Sequence[ChatMessage] | None, prompt: str | None
            ) -> tuple[list[int], tuple[list[int], int]]:
    """Prompt ids, prefill cuts and head for exactly one of `messages` (chat template) or `prompt` (raw text).

    Cuts follow the HTTP chat path (agentfold.serve.chat_turn.plan_cuts), so a session resumed over
    MCP restores the same snapshots, and gives the same bytes, as one resumed over HTTP.
    """
    if (messages is None) == (prompt is None):
        raise ToolError("Give exactly one of 'messages' (a chat, rendered with the model's template) "
                        "or 'prompt' (raw text).")
    runtime = service.runtime
    if prompt is not None:
        if not prompt:
            raise ToolError("'prompt' is empty; send some text.")
        return runtime.encode(prompt), ([], 0)
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


def _read_turn(service: Service, turn_id: str) -> dict[str, Any] | None:
    service.telemetry.flush(timeout=30)
    return service.telemetry.get_turn(turn_id)
