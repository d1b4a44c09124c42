"""A finished turn as the clients see it: its `TurnRecord`, the response telemetry blocks, the outcome hook.

The HTTP APIs and the MCP server both report a turn through here, so a response body, an MCP
tool result, the SQLite row and `/metrics` show the same figures. If an `after_turn` hook already
built the turn's record it is put in `turn.record` and used as is; otherwise one is built here
from the engine's `DecodeStats` and the runtime's clocks. This is the one place to change when
telemetry changes.
"""

from __future__ import annotations

import logging
from typing import Any

from agentfold.serve.scheduler import Runtime, Turn
from agentfold.serve.telemetry import TurnRecord, timings

log = logging.getLogger(__name__)


def turn_record(turn: Turn, runtime: Runtime) -> TurnRecord:
    """The turn's TurnRecord: the hook's if it made one, else built from the completion."""
    record = turn.record
    if isinstance(record, TurnRecord):
        return record
    assert turn.completion is not None
    request = turn.request
    record = TurnRecord.from_completion(
        turn.completion, session_id=request.session_id, api=request.api, client=request.client,
        model=runtime.model_id, queue_seconds=turn.queue_seconds, turn_id=turn.id,
        started_at=turn.submitted_wall, tool_calls=turn.tool_calls,
    )
    record.finish_reason = turn.finish_reason or record.finish_reason
    record.audit = turn.audit
    record.mismatch_position = turn.mismatch_position
    return record


def turn_blocks(turn: Turn, runtime: Runtime) -> tuple[dict[str, Any], dict[str, Any]]:
    """(llama.cpp-style `timings`, the `agentfold` block) for the last chunk / body of a response."""
    record = turn_record(turn, runtime)
    block = {
        "turn_id": record.turn_id,
        "session_id": record.session_id,
        "token_sha": record.token_sha,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "head_tokens": record.head_tokens,
        "completion_tokens": record.completion_tokens,
        "queue_ms": round(record.queue_ms, 3),
        "prefill_ms": round(record.prefill_ms, 3),
        "ttft_ms": round(record.ttft_ms, 3),
        "decode_ms": round(record.decode_ms, 3),
        "total_ms": round(record.total_ms, 3),
        "decode_tps": round(record.decode_tps, 3),
        "draft_method": record.draft_method,
        "verify_passes": record.verify_passes,
        "drafted": record.drafted,
        "accepted": record.accepted,
        "tokens_per_pass": round(record.tokens_per_pass, 3),
        "acceptance_rate": round(record.acceptance_rate, 4),
        "exactness": runtime.engine.exactness.describe(),
        "audit": turn.audit,
        "mismatch_position": turn.mismatch_position,
    }
    if turn.lane_passes:  # its verify passes as run: how many replies and rows each held (lanes)
        replies, rows = (sum(values) / len(turn.lane_passes) for values in zip(*turn.lane_passes, strict=True))
        block["lanes"] = {"shared_passes": sum(1 for count, _ in turn.lane_passes if count > 1),
                          "replies_per_pass": round(replies, 3), "rows_per_pass": round(rows, 3)}
    if turn.request.max_tokens_clamped:  # more than the context leaves was asked (llama-server clamps too)
        block["max_tokens_clamped"] = turn.request.max_tokens_clamped
    return timings(record), block


def report_outcome(runtime: Runtime, turn: Turn, finish: str, tool_calls: int) -> None:
    """The API-level outcome to the `after_response` hook (the turn's one telemetry write)."""
    turn.finish_reason, turn.tool_calls = finish, tool_calls
    if runtime.after_response is not None:
        try:
            runtime.after_response(turn)
        except Exception:  # telemetry must never cost the client its reply
            log.exception("after_response hook failed for %s", turn.id)
