"""The MCP tools' structured results: pydantic models, so every result carries an `output_schema`.

Agents read `structured_content` without parsing text, so each tool returns one of these models
and the SDK derives the tool's output schema from it. Telemetry rows are returned without
`inputs` (the prompt and reply ids an audit replays) and `emit_ms` (one timestamp per token):
both grow with the conversation and would flood an agent's context. `TurnRow` is built from the
`TurnRecord` dataclass itself, so the MCP schema never drifts from the telemetry table.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from agentfold.serve.telemetry import TurnRecord

# Telemetry fields left out of tool results: both grow with the turn (see the module docstring).
HIDDEN_TURN_FIELDS = ("inputs", "emit_ms")


def turn_row(row: dict[str, Any]) -> dict[str, Any]:
    """A telemetry row without the fields that grow with the turn."""
    return {k: v for k, v in row.items() if k not in HIDDEN_TURN_FIELDS}


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
