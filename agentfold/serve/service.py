"""One serving process: runtime + sessions + telemetry + metrics + audits, wired by the runtime's hooks.

- `ready` (worker thread): a new conversation whose prompt head (system prompt and tools) another
  running turn is prefilling waits until that head's snapshot is stored, then restores it: four
  Claude Code sessions started at once in one folder prefill their ~11K-token head once.
- `before_turn` (worker thread): restore the longest usable snapshot of the prompt
  (SessionManager.restore); the engine prefills the rest in chunks the runtime schedules like
  verify passes, and the session layer snapshots the cache where the reply starts.
- `after_turn` (worker thread): record the turn in its session, build its TurnRecord (with the
  inputs an audit needs to replay it) and count it on /metrics.
- `after_response` (event loop): the API-level finish reason and tool-call count; the row is
  written to SQLite (writer thread) once, here, or in `after_turn` for turns no API reports.
- Audits (agentfold.serve.audit): `audit_turn` replays a stored turn serially (no drafts, no snapshot)
  and stores the verdict; `audit_rate` queues such replays for a share of turns after their reply.
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
from pathlib import Path
from typing import Any

from agentfold.engine.decode import Completion, GenerationConfig
from agentfold.serve import audit
from agentfold.serve.metrics import Metrics
from agentfold.serve.scheduler import Runtime, Turn, TurnRequest
from agentfold.serve.telemetry import TelemetryStore, TurnRecord
from agentfold.serve.turn_log import log_turn
from agentfold.sessions import SessionManager
from agentfold.sessions.index import default_home
from agentfold.sessions.snapshots import tokens_sha

log = logging.getLogger(__name__)


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
        self._head_owners: dict[str, Turn] = {}  # a prompt head's tokens hash -> the turn prefilling it
        runtime.ready = self._ready
        runtime.before_turn = self._before_turn
        runtime.after_turn = self._after_turn
        runtime.after_cancel = self._after_cancel
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
    def _ready(self, turn: Turn) -> bool:
        """False while another live turn is prefilling this turn's prompt head: its snapshot, stored
        when that prefill passes the head, will be restored here instead of computing it twice."""
        request = turn.request
        if self.sessions is None or request.internal or request.cache is not None or not request.head:
            return True
        key = tokens_sha(request.prompt[: request.head])
        owner = self._head_owners.get(key)
        if owner is not None and owner is not turn and owner.status == "running" and not _past_head(owner):
            return False
        self._head_owners = {k: t for k, t in self._head_owners.items() if t.status in ("queued", "running")}
        self._head_owners[key] = turn
        return True

    def _before_turn(self, turn: Turn) -> None:
        request = turn.request
        if self.sessions is None or request.internal or request.cache is not None:
            return
        try:
            prepared = self.sessions.restore(request.prompt, request.session_id, request.cuts, request.head)
        except (OSError, sqlite3.Error) as error:  # disk full / read-only: the reply is the same without it
            log.warning("session store failed (%s): turn %s runs without its session cache", error, turn.id)
            return
        request.cache, request.cuts, request.session_id = prepared.cache, tuple(prepared.cuts), prepared.session_id
        request.on_prefill = prepared.snapshot_at_reply  # the engine's prefill chunks are scheduled passes
        turn.session = prepared

    def _after_cancel(self, turn: Turn) -> None:
        """Keep what a cancelled turn prefilled: a client that gives up on a long first turn and sends
        it again (Claude Code after 10 min of a stream with only pings) resumes from the last chunk,
        not from zero."""
        prepared, turn.session = turn.session, None
        if prepared is None:
            return
        try:
            prepared.snapshot_prefilled(prepared.cache)
        except (OSError, sqlite3.Error) as error:
            log.warning("session store failed (%s): cancelled turn %s's prefill is not kept", error, turn.id)

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
        record.head_tokens = info.head_tokens if info else 0
        record.audit, record.mismatch_position = turn.audit, turn.mismatch_position
        record.inputs = {**audit.config_inputs(request.prompt, request.config, request.cuts),
                         "reply": list(completion.tokens)}
        turn.record = record
        if request.internal:
            return
        if not request.outcome_follows:  # else `_after_response` writes it, with the API's outcome
            self.telemetry.record(record)
            log_turn(record)
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
        log_turn(record)
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
        """Replay a stored turn serially (agentfold.serve.audit.replay) and store the verdict on its row."""
        row = self.telemetry.get_turn(turn_id)
        if row is None:
            raise KeyError(f"no turn {turn_id!r}")
        verdict = await audit.replay(self.run_turn, turn_id, row.get("inputs") or {})
        self.telemetry.set_audit(turn_id, verdict["verdict"], verdict["mismatch_position"], verdict["audit_token_sha"])
        self.metrics.observe_audit(verdict["verdict"])
        return verdict

    async def check_exactness(self, prompt: list[int], config: GenerationConfig) -> dict[str, Any]:
        """Drafted against serial for the same prompt (agentfold.serve.audit.check_exactness)."""
        return await audit.check_exactness(self.run_turn, prompt, config)

    def close(self) -> None:
        self.runtime.close()
        if self.sessions is not None:
            self.sessions.flush()  # snapshots staged by the last turns reach the disk
        self.telemetry.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _past_head(turn: Turn) -> bool:
    """Whether `turn` no longer stands to store its prompt head's snapshot: it restored one, stored
    one, or runs without a session (nothing to wait for)."""
    prepared = turn.session
    return prepared is None or not prepared.head or prepared.head_saved is not None or prepared.cached >= prepared.head
