"""One serving process: runtime + sessions + telemetry + metrics + audits, wired by the runtime's hooks.

- `before_turn` (worker thread): restore the longest usable snapshot of the prompt
  (SessionManager.restore); the engine prefills the rest in chunks the runtime schedules like
  verify passes, and the session layer snapshots the cache where the reply starts.
- `after_turn` (worker thread): record the turn in its session, build its TurnRecord (with the
  inputs an audit needs to replay it) and count it on /metrics.
- `after_response` (event loop): the API-level finish reason and tool-call count; the row is
  written to SQLite (writer thread) once, here, or in `after_turn` for turns no API reports.
- Audits: `audit_turn` replays a stored turn serially (no drafts, no snapshot) and compares token
  ids; `audit_rate` queues such replays for a share of turns after their reply went out.
- Storage faults never cost a reply: a home that cannot be written (read-only, full) at start-up
  turns sessions off and keeps telemetry in a temporary file, with a warning; a session write that
  fails later (disk full) logs a warning and that turn runs without its session cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import sqlite3
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from agentfold.engine.decode import Completion, GenerationConfig, token_sha
from agentfold.engine.sampler import SamplingParams
from agentfold.metrics import Metrics
from agentfold.runtime import Runtime, Turn, TurnRequest
from agentfold.sessions import SessionManager
from agentfold.sessions.index import default_home
from agentfold.telemetry import TelemetryStore, TurnRecord

log = logging.getLogger(__name__)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def config_inputs(prompt: list[int], config: GenerationConfig) -> dict[str, Any]:
    """What replaying a turn needs, JSON-ready."""
    return {"prompt": list(prompt), "params": asdict(config.params), "max_tokens": config.max_tokens,
            "stop": list(config.stop), "grammar": config.grammar, "draft": config.draft}


def config_from_inputs(inputs: dict[str, Any], draft: bool) -> GenerationConfig:
    return GenerationConfig(params=SamplingParams(**inputs["params"]), max_tokens=inputs["max_tokens"],
                            stop=tuple(inputs["stop"]), draft=draft, grammar=inputs.get("grammar"))


def unwritable(path: Path) -> str | None:
    """None when files can be created (and removed) in `path`; else the reason, e.g. 'Read-only file system'."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".agentfold-probe-", dir=path)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        return error.strerror or str(error)
    return None


class Service:
    """Everything `agentfold serve` (and the MCP server) runs around one engine."""

    def __init__(self, runtime: Runtime, home: str | Path | None = None, sessions: bool = True,
                 audit_rate: float = 0.0) -> None:
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError(f"audit rate must be in [0, 1], not {audit_rate}")
        self.runtime = runtime
        self.engine = runtime.engine
        self.home = Path(home) if home else default_home()
        self._scratch: Path | None = None
        problem = unwritable(self.home) or (unwritable(self.home / "snapshots") if sessions else None)
        self.persistent = problem is None
        if problem:
            log.warning("%s cannot be written (%s): serving WITHOUT persistence (no session snapshots; "
                        "telemetry in a temporary file, lost at exit)", self.home, problem)
        self.sessions = self._open_sessions() if sessions and self.persistent else None
        self.telemetry = self._open_telemetry()
        self.metrics = Metrics()
        self.audit_rate = audit_rate
        self._random = random.Random(0)
        runtime.before_turn = self._before_turn
        runtime.after_turn = self._after_turn
        runtime.after_response = self._after_response

    def _open_sessions(self) -> SessionManager | None:
        try:
            return SessionManager(self.engine, self.home)
        except (OSError, sqlite3.Error) as error:
            log.warning("session index in %s unusable (%s): serving without session snapshots", self.home, error)
            return None

    def _open_telemetry(self) -> TelemetryStore:
        if self.persistent:
            try:
                return TelemetryStore(self.home / "telemetry.sqlite")
            except (OSError, sqlite3.Error) as error:
                log.warning("telemetry in %s unusable (%s): keeping it in a temporary file", self.home, error)
        self._scratch = Path(tempfile.mkdtemp(prefix="agentfold-telemetry-"))
        return TelemetryStore(self._scratch / "telemetry.sqlite")

    # -- hooks (worker thread, except after_response) ---------------------------------------------
    def _before_turn(self, turn: Turn) -> None:
        request = turn.request
        if self.sessions is None or request.meta.get("no_session") or request.cache is not None:
            return
        try:
            prepared = self.sessions.restore(request.prompt, request.session_id, request.cuts)
        except (OSError, sqlite3.Error) as error:  # disk full / read-only: the reply is the same without it
            log.warning("session store failed (%s): turn %s runs without its session cache", error, turn.id)
            return
        request.cache, request.cuts, request.session_id = prepared.cache, tuple(prepared.cuts), prepared.session_id
        request.on_prefill = prepared.snapshot_at_reply  # the engine's prefill chunks are scheduled passes
        turn.session = prepared

    def _after_turn(self, turn: Turn) -> None:
        completion = turn.completion
        assert completion is not None
        prepared, turn.session = turn.session, None
        info = None
        if prepared is not None:
            try:
                info = self.sessions.finish(prepared, completion)
            except (OSError, sqlite3.Error) as error:
                log.warning("session store failed (%s): turn %s is not recorded in its session", error, turn.id)
        request = turn.request
        record = TurnRecord.from_completion(
            completion, session_id=request.session_id, api=request.api, client=request.client,
            model=self.runtime.model_id, queue_seconds=turn.queue_seconds, turn_id=turn.id,
            started_at=turn.submitted_wall,
            cache_restore_seconds=info.restore_seconds if info else 0.0,
            snapshot_id=info.snapshot_id if info else None,
            cache_miss_reason="; ".join(info.miss_reasons) if info and info.miss_reasons else None,
        )
        record.audit, record.mismatch_position = turn.audit, turn.mismatch_position
        record.inputs = {**config_inputs(request.prompt, request.config), "reply": list(completion.tokens)}
        turn.record = record
        if request.meta.get("internal"):
            return
        if not request.outcome_follows:  # else `_after_response` writes it, with the API's outcome
            self.telemetry.record(record)
        self.metrics.observe(record)
        if turn.audit != "skipped":
            self.metrics.observe_audit(turn.audit)

    def _after_response(self, turn: Turn) -> None:
        record = turn.record
        if not isinstance(record, TurnRecord):
            return
        record.finish_reason = turn.finish_reason or record.finish_reason
        record.tool_calls = turn.tool_calls
        self.telemetry.record(record)
        if self.audit_rate and self._random.random() < self.audit_rate and record.draft_method != "none":
            asyncio.get_running_loop().create_task(self.audit_turn(record.turn_id))

    # -- turns from code (MCP tools, audits) ------------------------------------------------------
    async def run_turn(self, request: TurnRequest, on_tokens: Any = None) -> tuple[Completion, Turn]:
        """Submit a turn and wait for it; `on_tokens(count)` after every verify pass."""
        turn = self.runtime.submit(request)
        count = 0
        async for event in turn.events():
            if isinstance(event, Completion):
                return event, turn
            count += len(event.tokens)
            if on_tokens is not None:
                await on_tokens(count)
        raise RuntimeError(f"turn {turn.id} ended without a completion")

    async def audit_turn(self, turn_id: str) -> dict[str, Any]:
        """Replay a stored turn serially from an empty cache and compare token ids; store the verdict."""
        row = self.telemetry.get_turn(turn_id)
        if row is None:
            raise KeyError(f"no turn {turn_id!r}")
        inputs = row.get("inputs") or {}
        if not inputs.get("prompt"):
            raise ValueError(f"turn {turn_id!r} has no stored inputs to replay")
        reference, _ = await self.run_turn(TurnRequest(
            prompt=inputs["prompt"], config=config_from_inputs(inputs, draft=False), api="audit",
            meta={"no_session": True, "internal": True}))
        replied = list(inputs.get("reply") or [])
        mismatch = first_mismatch(replied, reference.tokens)
        verdict = "passed" if mismatch is None else "failed"
        self.telemetry.set_audit(turn_id, verdict, mismatch, token_sha(reference.tokens))
        self.metrics.observe_audit(verdict)
        return {"turn_id": turn_id, "verdict": verdict, "mismatch_position": mismatch,
                "token_sha": token_sha(replied), "audit_token_sha": token_sha(reference.tokens)}

    async def check_exactness(self, prompt: list[int], config: GenerationConfig) -> dict[str, Any]:
        """Drafted against serial for the same prompt: equal or not, where, both hashes and timings."""
        results = {}
        for name, draft in (("drafted", True), ("serial", False)):
            completion, turn = await self.run_turn(TurnRequest(
                prompt=prompt, config=replace(config, draft=draft), api="mcp",
                meta={"no_session": True, "internal": True}))
            stats = completion.stats
            results[name] = {"tokens": len(completion.tokens), "token_sha": completion.token_sha,
                             "decode_tps": round(stats.decode_tps, 3), "total_ms": round(stats.total_seconds * 1e3, 3),
                             "ttft_ms": round(stats.ttft_seconds * 1e3, 3), "verify_passes": stats.verify_passes,
                             "drafted": stats.drafted, "accepted": stats.accepted, "_ids": completion.tokens}
        mismatch = first_mismatch(results["drafted"].pop("_ids"), results["serial"].pop("_ids"))
        return {"equal": mismatch is None, "mismatch_position": mismatch, **results}

    def close(self) -> None:
        self.runtime.close()
        self.telemetry.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def build_app(service: Service, api_key: str | None = None, default_max_tokens: int | None = None,
              host: str = "127.0.0.1", max_body_bytes: int | None = None, cors_origins: Sequence[str] = ()) -> Any:
    """The HTTP app of a service: the APIs, `/metrics` (Prometheus), `/dashboard` and MCP at `/mcp`.

    `host`, `api_key`, `max_body_bytes` and `cors_origins` apply to every route (see server.guard).
    """
    from starlette.responses import Response
    from starlette.routing import Route

    from agentfold.mcp_server import mount_mcp
    from agentfold.server.app import create_app
    from agentfold.server.dashboard import dashboard_routes
    from agentfold.server.guard import DEFAULT_MAX_BODY_BYTES

    limit = max_body_bytes or DEFAULT_MAX_BODY_BYTES

    async def metrics(request: Any) -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    mcp_routes, lifespan = mount_mcp(service, api_key=api_key, host=host, max_body_bytes=limit,
                                     cors_origins=cors_origins)
    return create_app(service.runtime, api_key=api_key, default_max_tokens=default_max_tokens,
                      extra_routes=[Route("/metrics", metrics, methods=["GET"]), *dashboard_routes(service.telemetry),
                                    *mcp_routes], lifespan=lifespan, host=host, max_body_bytes=limit,
                      cors_origins=cors_origins)
