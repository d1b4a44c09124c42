"""Per-turn telemetry (DESIGN contract 3): one `TurnRecord` per turn, kept in SQLite.

The record is built from the engine's own clocks and counters (`DecodeStats`), so the numbers a
response reports, the row in SQLite and `/metrics` are the same figures. Writes go through one
writer thread fed by a queue: serving a token never waits on the disk, and SQLite sees a single
writer (WAL lets readers, each on its own connection, run alongside it).

Conventions: times are milliseconds (floats) except `started_at`, which is Unix seconds; lists
(`accepted_per_position`, `proposed_per_position`, `emit_ms`) are stored as JSON text.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
import types
import typing
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

if TYPE_CHECKING:
    from agentfold.engine.decode import Completion

log = logging.getLogger(__name__)

AUDIT_VERDICTS = ("skipped", "passed", "failed")


@dataclass
class TurnRecord:
    """Everything one turn cost, as one flat row (field groups follow DESIGN contract 3)."""

    # identity
    turn_id: str
    session_id: str | None
    api: str  # chat | completions | responses | messages | mcp | cli
    client: str  # from the User-Agent, or the MCP client's name
    model: str
    started_at: float  # Unix seconds when the request arrived
    finish_reason: str  # stop | length | tool_calls | error
    status: str = "ok"
    # tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0
    head_tokens: int = 0  # of cached_tokens, those restored from a prompt head shared by conversations
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: int = 0
    # time (ms); ttft and total count from the request's arrival (queue and restore included)
    queue_ms: float = 0.0
    cache_restore_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    # rates (tokens per second)
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    # inter-token latency (ms) over the gaps between consecutive emitted tokens, and verify passes
    itl_p50: float = 0.0
    itl_p90: float = 0.0
    itl_p99: float = 0.0
    itl_max: float = 0.0
    pass_p50: float = 0.0
    pass_p99: float = 0.0
    # drafting
    draft_method: str = "none"
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    discarded: int = 0
    tokens_per_pass: float = 0.0
    acceptance_rate: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    # cache
    snapshot_id: str | None = None
    cache_match_tokens: int = 0
    cache_miss_reason: str | None = None
    # exactness
    audit: str = "skipped"  # skipped | passed | failed
    mismatch_position: int | None = None
    token_sha: str = ""
    audit_token_sha: str | None = None
    # raw clock: when each token was emitted, ms since the engine started the turn (tokens of
    # one verify pass share a time). Kept so summaries and histograms use real gaps, not
    # percentiles of percentiles.
    emit_ms: list[float] = field(default_factory=list)
    # MoE expert offload of the turn (hit rate, experts per layer by tier, swaps, time split); None without
    offload: dict[str, Any] | None = None
    # what replaying the turn needs (prompt ids, sampling, limits, reply ids): audits read it
    inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_completion(
        cls,
        completion: Completion,
        *,
        session_id: str | None,
        api: str,
        client: str,
        model: str,
        queue_seconds: float = 0.0,
        cache_restore_seconds: float = 0.0,
        snapshot_id: str | None = None,
        cache_miss_reason: str | None = None,
        tool_calls: int = 0,
        status: str = "ok",
        turn_id: str | None = None,
        started_at: float | None = None,
        cache_match_tokens: int | None = None,
    ) -> TurnRecord:
        """The row for a finished reply. `started_at` defaults to now minus the turn's duration;
        `cache_match_tokens` (the stored prefix found) defaults to the tokens actually reused."""
        stats = completion.stats
        lead_ms = (queue_seconds + cache_restore_seconds) * 1e3
        total_ms = lead_ms + stats.total_seconds * 1e3
        emit_ms = [t * 1e3 for t in stats.emit_times]
        itl = _percentiles(np.diff(emit_ms), (50, 90, 99, 100))
        passes = _percentiles([s * 1e3 for s in stats.pass_seconds], (50, 99))
        return cls(
            turn_id=turn_id or uuid.uuid4().hex,
            session_id=session_id,
            api=api,
            client=client,
            model=model,
            started_at=time.time() - total_ms / 1e3 if started_at is None else started_at,
            finish_reason=completion.finish_reason,
            status=status,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
            prefilled_tokens=stats.prefilled_tokens,
            completion_tokens=stats.completion_tokens,
            tool_calls=tool_calls,
            queue_ms=queue_seconds * 1e3,
            cache_restore_ms=cache_restore_seconds * 1e3,
            prefill_ms=stats.prefill_seconds * 1e3,
            ttft_ms=lead_ms + stats.ttft_seconds * 1e3,
            decode_ms=stats.decode_seconds * 1e3,
            total_ms=total_ms,
            prefill_tps=stats.prefilled_tokens / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
            decode_tps=stats.decode_tps,
            itl_p50=itl[0],
            itl_p90=itl[1],
            itl_p99=itl[2],
            itl_max=itl[3],
            pass_p50=passes[0],
            pass_p99=passes[1],
            draft_method=stats.draft_method,
            verify_passes=stats.verify_passes,
            drafted=stats.drafted,
            accepted=stats.accepted,
            discarded=stats.discarded,
            tokens_per_pass=stats.tokens_per_pass,
            acceptance_rate=stats.acceptance_rate,
            accepted_per_position=list(stats.accepted_per_position),
            proposed_per_position=list(stats.proposed_per_position),
            snapshot_id=snapshot_id,
            cache_match_tokens=stats.cached_tokens if cache_match_tokens is None else cache_match_tokens,
            cache_miss_reason=cache_miss_reason,
            token_sha=completion.token_sha,
            emit_ms=emit_ms,
            offload=getattr(stats, "offload", None),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (lists are copied)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRecord:
        """The inverse of `to_dict`; unknown keys (columns added later) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def timings(record: TurnRecord) -> dict[str, float | int]:
    """llama.cpp-style `timings` for the last chunk of a response.

    The same figures as the record (DESIGN: one set of numbers everywhere): `prompt_*` is the
    prefill of the uncached tokens, `predicted_*` the decode after the first token, and the
    rates are the record's own `prefill_tps` / `decode_tps`.
    """
    return {
        "cache_n": record.cached_tokens,
        "prompt_n": record.prefilled_tokens,
        "prompt_ms": record.prefill_ms,
        "prompt_per_token_ms": 1e3 / record.prefill_tps if record.prefill_tps else 0.0,
        "prompt_per_second": record.prefill_tps,
        "predicted_n": record.completion_tokens,
        "predicted_ms": record.decode_ms,
        "predicted_per_token_ms": 1e3 / record.decode_tps if record.decode_tps else 0.0,
        "predicted_per_second": record.decode_tps,
        "draft_n": record.drafted,
        "draft_n_accepted": record.accepted,
    }


def _percentiles(values: Any, qs: tuple[float, ...]) -> list[float]:
    """numpy's (linear) percentiles as floats; zeros when there is nothing to measure."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return [0.0] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]


# --- SQLite ----------------------------------------------------------------------------------

_HINTS = typing.get_type_hints(TurnRecord)


def _unwrap_optional(hint: Any) -> Any:
    """X for `X | None`, else the hint itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


JSON_FIELDS = tuple(name for name, hint in _HINTS.items() if typing.get_origin(_unwrap_optional(hint)) in (list, dict))


def _column_type(hint: Any) -> type:
    """SQLite column type of a field: lists and dicts are JSON text, `X | None` is a nullable X."""
    hint = _unwrap_optional(hint)
    return str if typing.get_origin(hint) in (list, dict) else hint


COLUMNS: dict[str, type] = {name: _column_type(hint) for name, hint in _HINTS.items()}
NULLABLE = {name for name, hint in _HINTS.items() if type(None) in typing.get_args(hint)}


def _to_row(record: TurnRecord) -> dict[str, Any]:
    row = record.to_dict()
    for name in JSON_FIELDS:
        row[name] = None if row[name] is None else json.dumps(row[name])
    return row


def _from_row(row: dict[str, Any]) -> dict[str, Any]:
    """A stored row as `to_dict` gives it (JSON columns decoded, unknown columns kept)."""
    out = dict(row)
    for name in JSON_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = json.loads(out[name])
    return out


@dataclass
class _Audit:
    turn_id: str
    verdict: str
    mismatch_position: int | None
    audit_token_sha: str | None
    done: threading.Event = field(default_factory=threading.Event)
    updated: bool = False
    error: BaseException | None = None


@dataclass
class _Barrier:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


class TelemetryStore:
    """The `turns` table of one SQLite file: one writer thread, readers on their own connections.

    `record` only puts the row on a queue, so callers on the decode path never wait for SQLite.
    `flush` waits until everything queued before it is committed. Reads open a short-lived
    connection in the calling thread (sqlite3 connections are bound to the thread that made them).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = self._connect()
        try:
            db.enable_wal()
            db["turns"].create(COLUMNS, pk="turn_id", not_null=set(COLUMNS) - NULLABLE, if_not_exists=True)
            db["turns"].create_index(["started_at"], if_not_exists=True)
            db["turns"].create_index(["session_id", "started_at"], if_not_exists=True)
        finally:
            db.close()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="telemetry-writer", daemon=True)
        self._thread.start()

    # --- writing (through the writer thread) ---

    def record(self, turn: TurnRecord) -> None:
        """Queue a turn for writing and return at once (a second record of a turn_id replaces it)."""
        self._check_open()
        self._queue.put(turn)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every turn queued so far is committed; raise if a write failed since the last flush."""
        self._check_open()
        barrier = _Barrier()
        self._queue.put(barrier)
        if not barrier.done.wait(timeout):
            raise TimeoutError(f"telemetry writer did not catch up within {timeout} s")
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a telemetry write failed: {error}") from error

    def set_audit(self, turn_id: str, verdict: str, mismatch_position: int | None = None,
                  audit_token_sha: str | None = None) -> bool:
        """Store an audit's outcome for a turn (after any queued write of it); False if no such turn."""
        if verdict not in AUDIT_VERDICTS:
            raise ValueError(f"audit verdict must be one of {AUDIT_VERDICTS}, not {verdict!r}")
        self._check_open()
        op = _Audit(turn_id, verdict, mismatch_position, audit_token_sha)
        self._queue.put(op)
        op.done.wait()
        if op.error is not None:
            raise RuntimeError(f"storing the audit of {turn_id} failed: {op.error}") from op.error
        return op.updated

    def close(self) -> None:
        """Write what is queued, stop the writer thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def __enter__(self) -> TelemetryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the telemetry store is closed")

    def _connect(self) -> Database:
        conn = sqlite3.connect(self.path, timeout=5.0)
        conn.execute("PRAGMA busy_timeout = 5000")
        return Database(conn)

    def _write_loop(self) -> None:
        db = self._connect()
        db.execute("PRAGMA synchronous = NORMAL")  # safe with WAL; a crash loses at most the last commits
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while True:  # take whatever else is waiting: one transaction for a burst of turns
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = self._apply(db, batch)
        finally:
            db.close()

    def _apply(self, db: Database, batch: list[Any]) -> bool:
        """Write a batch in queue order; wake the threads waiting on it. True once told to stop."""
        rows: list[dict[str, Any]] = []

        def insert(chunk: list[dict[str, Any]]) -> None:
            db["turns"].insert_all(chunk, pk="turn_id", replace=True, alter=True)

        def write_rows() -> None:
            if not rows:
                return
            try:
                insert(rows)
            except Exception:  # one bad row must not cost the others: retry them one by one
                for row in rows:
                    try:
                        insert([row])
                    except Exception as error:  # keep serving; flush() reports it
                        log.exception("writing telemetry row %s failed", row.get("turn_id"))
                        self._error = error
            rows.clear()

        stop = False
        for op in batch:
            if isinstance(op, TurnRecord):
                rows.append(_to_row(op))
                continue
            write_rows()
            if isinstance(op, _Audit):
                try:
                    db["turns"].update(op.turn_id, {"audit": op.verdict, "mismatch_position": op.mismatch_position,
                                                    "audit_token_sha": op.audit_token_sha})
                    op.updated = True
                except NotFoundError:
                    op.updated = False
                except Exception as error:
                    op.error = error
                op.done.set()
            elif isinstance(op, _Barrier):
                op.done.set()
            elif op is _STOP:
                stop = True
        write_rows()
        return stop

    # --- reading (own connection per call) ---

    def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        """The stored row of a turn, shaped like `TurnRecord.to_dict()`, or None."""
        rows = self._select("SELECT * FROM turns WHERE turn_id = ?", [turn_id])
        return rows[0] if rows else None

    def list_turns(self, session_id: str | None = None, since: float | None = None,
                   limit: int = 100) -> list[dict[str, Any]]:
        """Turns newest first, optionally of one session and/or started at or after `since` (Unix s)."""
        where, params = self._where(session_id=session_id, since=since)
        return self._select(f"SELECT * FROM turns {where} ORDER BY started_at DESC, rowid DESC LIMIT ?",
                            [*params, int(limit)])

    def latency_summary(self, window_seconds: float | None = None, last_n: int | None = None) -> dict[str, Any]:
        """Latency and efficiency over the turns of the last `window_seconds` and/or the last `last_n`
        (all turns when neither is given).

        TTFT percentiles are over turns; ITL percentiles over every inter-token gap of those turns
        (ms, numpy's linear percentiles). Rates and shares are ratios of sums, except `decode_tps`,
        the mean of the per-turn rates that exist. Latency figures use turns with status "ok";
        `errors` counts the rest. Percentiles are None when there is nothing to measure.
        """
        since = time.time() - window_seconds if window_seconds is not None else None
        where, params = self._where(since=since)
        limit = "LIMIT ?" if last_n is not None else ""
        rows = self._select(f"SELECT * FROM turns {where} ORDER BY started_at DESC, rowid DESC {limit}",
                            [*params, *([int(last_n)] if last_n is not None else [])])
        ok = [r for r in rows if r["status"] == "ok"]
        ttft = [r["ttft_ms"] for r in ok]
        gaps = [g for r in ok for g in np.diff(r["emit_ms"]).tolist()]
        rates = [r["decode_tps"] for r in ok if r["decode_tps"] > 0]

        def total(name: str) -> int:
            return sum(r[name] for r in ok)

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        def ratio(num: float, den: float) -> float | None:
            return num / den if den else None

        return {
            "turns": len(rows),
            "errors": len(rows) - len(ok),
            "window_seconds": window_seconds,
            "last_n": last_n,
            "ttft_p50": pct(ttft, 50),
            "ttft_p90": pct(ttft, 90),
            "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(gaps, 50),
            "itl_p90": pct(gaps, 90),
            "itl_p99": pct(gaps, 99),
            "decode_tps": float(np.mean(rates)) if rates else None,
            "tokens_per_pass": ratio(total("completion_tokens"), total("verify_passes")),
            "acceptance_rate": ratio(total("accepted"), total("drafted")),
            "cache_hit_share": ratio(total("cached_tokens"), total("prompt_tokens")),
            "audits_passed": sum(r["audit"] == "passed" for r in rows),
            "audits_failed": sum(r["audit"] == "failed" for r in rows),
        }

    @staticmethod
    def _where(session_id: str | None = None, since: float | None = None) -> tuple[str, list[Any]]:
        clauses, params = [], []
        if session_id is not None:
            clauses.append("session_id = ?")
            params.append(session_id)
        if since is not None:
            clauses.append("started_at >= ?")
            params.append(since)
        return ("WHERE " + " AND ".join(clauses) if clauses else ""), params

    def _select(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        db = self._connect()
        try:
            return [_from_row(row) for row in db.query(sql, params)]
        finally:
            db.close()
