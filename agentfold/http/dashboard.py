"""`/dashboard`: one self-contained page (no external assets) about the server and its recent turns.

The page (`dashboard_page.PAGE`) fetches `/dashboard/turns.json`: the telemetry rows (oldest
first), the latency summary, the server (model, exactness verdict, drafting state, load) and the
sessions seen in telemetry (count and the most recent). It refreshes every five seconds.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from agentfold.http.dashboard_page import DATA_PATH, PAGE

FIELDS = ("turn_id", "session_id", "api", "started_at", "status", "finish_reason", "ttft_ms", "decode_tps",
          "tokens_per_pass", "acceptance_rate", "drafted", "accepted", "completion_tokens", "cached_tokens",
          "prompt_tokens", "total_ms", "draft_method", "audit")
RECENT_SESSIONS = 10

# Sessions as telemetry saw them: one aggregate over the `turns` table (the store's public schema).
SESSIONS_SQL = """
SELECT session_id, COUNT(*) AS turns, MAX(started_at) AS last_turn_at,
       SUM(prompt_tokens) AS prompt_tokens, SUM(cached_tokens) AS cached_tokens
FROM turns WHERE session_id IS NOT NULL GROUP BY session_id ORDER BY last_turn_at DESC
"""


def _rounded(value: Any) -> Any:
    """Floats to 3 decimals: the page shows them rounded anyway, the JSON stays small."""
    return round(value, 3) if isinstance(value, float) else value


def server_state(runtime: Any) -> dict[str, Any]:
    """Model, exactness verdict, drafting state and load of the runtime serving the page."""
    engine = runtime.engine
    exactness = engine.exactness
    drafter = getattr(engine, "drafter", None)
    return {
        "model": runtime.model_id,
        "exactness": exactness.describe(),
        "drafting": {"enabled": bool(drafter is not None and exactness.drafting),
                     "method": drafter.name if drafter is not None else "none",
                     "max_width": exactness.max_width},
        "active": runtime.active,
        "waiting": runtime.waiting,
        "max_active": runtime.max_active,
        "context_length": runtime.context_length,
    }


def session_state(telemetry: Any, recent: int = RECENT_SESSIONS) -> dict[str, Any]:
    """How many sessions telemetry has turns of, and the `recent` last used (a read-only connection:
    the store's writer thread is never waited on)."""
    db = sqlite3.connect(f"file:{telemetry.path}?mode=ro", uri=True, timeout=5)
    try:
        db.row_factory = sqlite3.Row
        rows = [dict(row) for row in db.execute(SESSIONS_SQL)]
    finally:
        db.close()
    for row in rows:
        row["cache_share"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None
    return {"count": len(rows), "recent": [{k: _rounded(v) for k, v in row.items()} for row in rows[:recent]]}


def dashboard_data(telemetry: Any, runtime: Any, limit: int) -> dict[str, Any]:
    """Everything the page reads (see `dashboard_page`)."""
    rows = list(reversed(telemetry.list_turns(limit=limit)))
    summary = telemetry.latency_summary(last_n=limit)
    return {"server": server_state(runtime),
            "summary": {k: _rounded(v) for k, v in summary.items()},
            "sessions": session_state(telemetry),
            "turns": [{k: _rounded(row.get(k)) for k in FIELDS} for row in rows]}


def dashboard_routes(telemetry: Any, limit: int = 200) -> list[Route]:
    """The page and its data, for `create_app(extra_routes=...)` (the runtime is the app's own)."""

    async def page(request: Request) -> HTMLResponse:
        return HTMLResponse(PAGE)

    async def turns(request: Request) -> JSONResponse:
        return JSONResponse(dashboard_data(telemetry, request.app.state.runtime, limit))

    return [Route("/dashboard", page, methods=["GET"]), Route(DATA_PATH, turns, methods=["GET"])]
