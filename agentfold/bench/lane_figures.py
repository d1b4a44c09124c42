"""`bench lanes`' figures: one level's row from its run (tokens, rates, latency per client and
session, lanes, every turn against its solo run), and a level's runs merged into one row.

Split from `bench/lanes.py`, which runs the levels; this module only reads what they left.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from agentfold.bench.machine import loadavg


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def emit_clock(turn: Any, completion: Any) -> list[float]:
    """When each token of a turn was committed, on the bench's clock (perf_counter): the engine's
    emit times are relative to its own start, which the turn's first delivery pins down."""
    emits = completion.stats.emit_times
    if not emits or turn.first_delta_at is None:
        return []
    offset = turn.first_delta_at - emits[0]
    return [offset + t for t in emits]


def _latency(turns: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    """ITL percentiles over the gaps between committed tokens inside each turn, pooled; TTFT median."""
    from agentfold.serve.telemetry import _percentiles

    gaps, ttfts = [], []
    for turn, completion in turns:
        times = emit_clock(turn, completion)
        gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
        if turn.ttft_seconds is not None:
            ttfts.append(turn.ttft_seconds * 1e3)
    p50, p99 = _percentiles(gaps, (50, 99))
    return {"ttft_ms_median": _r(statistics.median(ttfts)) if ttfts else None, "itl_p50_ms": _r(p50),
            "itl_p99_ms": _r(p99), "itl_max_ms": _r(max(gaps, default=0.0))}


def _drafting(turns: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
    stats = [completion.stats for _, completion in turns]
    passes, tokens = sum(s.verify_passes for s in stats), sum(s.completion_tokens for s in stats)
    return {"completion_tokens": tokens, "verify_passes": passes, "drafted": sum(s.drafted for s in stats),
            "accepted": sum(s.accepted for s in stats), "tokens_per_pass": _r(tokens / passes, 4) if passes else None}


def _mismatch(turns: Sequence[tuple[Any, Any]], reference: Sequence[tuple[Any, Any]]) -> dict[str, Any] | None:
    """Where a session's turns first differ from the same session's solo turns (None: equal)."""
    from agentfold.engine.decode import first_mismatch

    for k, ((_, completion), (_, solo)) in enumerate(zip(turns, reference, strict=True)):
        at = first_mismatch(completion.tokens, solo.tokens)
        if at is not None or completion.finish_reason != solo.finish_reason:
            return {"turn": k, "first_mismatch": at, "tokens": len(completion.tokens), "solo_tokens": len(solo.tokens)}
    return None


def session_row(session: dict[str, Any], served: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """One session's figures at one level: drafting, latency, lanes, and equality with its solo run
    (`reference`: level 1's; None for level 1 itself)."""
    turns = served["turns"]
    mismatch = None if reference is None else _mismatch(turns, reference["turns"])
    return {"index": session["index"], "name": session["name"], "kind": session["kind"],
            "sampled": session["sampled"], "client": served["client"], "turns": len(turns),
            "token_shas": [completion.token_sha for _, completion in turns], **_drafting(turns), **_latency(turns),
            **_lane_columns([p for turn, _ in turns for p in getattr(turn, "lane_passes", [])]),
            "equal_to_solo": None if reference is None else mismatch is None, "mismatch": mismatch}


def _lane_columns(passes: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """How many replies and rows shared a session's verify passes (`Turn.lane_passes`)."""
    if not passes:
        return {"shared_passes": None, "replies_per_pass": None, "rows_per_pass": None}
    return {"shared_passes": sum(1 for replies, _ in passes if replies > 1),
            "replies_per_pass": _r(statistics.mean(replies for replies, _ in passes), 3),
            "rows_per_pass": _r(statistics.mean(rows for _, rows in passes), 3)}


def _client_rows(level: dict[str, Any]) -> list[dict[str, Any]]:
    """Per client: the sessions it served, its tokens and its latency pooled over them."""
    rows = []
    for client in range(level["clients"]):
        mine = sorted(i for i, s in level["served"].items() if s["client"] == client)
        turns = [t for i in mine for t in level["served"][i]["turns"]]
        rows.append({"client": client, "sessions": mine, "turns": len(turns),
                     "completion_tokens": sum(len(c.tokens) for _, c in turns), **_latency(turns)})
    return rows


def level_row(sessions: Sequence[dict[str, Any]], level: dict[str, Any],
              reference: dict[int, dict[str, Any]] | None) -> dict[str, Any]:
    """A level's figures: the pool's committed tokens over the time from the first submit to the
    last token (and over the stretch while every client was busy), per client latency, and every
    turn checked against the same session's solo turn (`reference`: level 1's sessions)."""
    rows = [session_row(s, level["served"][s["index"]], None if reference is None else reference[s["index"]])
            for s in sessions]
    seconds, steady_seconds = level["ended"] - level["began"], level["drained"] - level["began"]
    steady = sum(1 for s in level["served"].values() for turn, completion in s["turns"]
                 for t in emit_clock(turn, completion) if t <= level["drained"])
    tokens = sum(r["completion_tokens"] for r in rows)
    passes = sum(r["verify_passes"] for r in rows)
    checked = 0 if reference is None else sum(r["turns"] for r in rows)
    unequal = [r for r in rows if r["equal_to_solo"] is False]
    clients = _client_rows(level)
    return {
        "clients": level["clients"], "max_active": level["clients"], "sessions": len(rows),
        "turns": sum(r["turns"] for r in rows), "completion_tokens": tokens, "seconds": _r(seconds),
        "aggregate_tps": _r(tokens / seconds), "speedup_vs_1": None,  # filled in once level 1 is known
        "steady_seconds": _r(steady_seconds), "steady_tps": _r(steady / steady_seconds) if steady_seconds else None,
        "steady_tokens": steady,
        "drafted": sum(r["drafted"] for r in rows), "accepted": sum(r["accepted"] for r in rows),
        "tokens_per_pass": _r(tokens / max(1, passes), 4),
        "itl_p50_ms_median": _r(statistics.median(c["itl_p50_ms"] for c in clients)),
        "itl_p99_ms": {str(c["client"]): c["itl_p99_ms"] for c in clients},
        "itl_p99_ms_max": _r(max(c["itl_p99_ms"] for c in clients)),
        "ttft_ms_median": _r(statistics.median(r["ttft_ms_median"] for r in rows if r["ttft_ms_median"] is not None)),
        "reference": reference is None,
        "equal_to_solo": {"checked": checked, "equal": checked - sum(r["turns"] for r in unequal)},
        "mismatches": [{"clients": level["clients"], "index": r["index"], "name": r["name"], **r["mismatch"]}
                       for r in unequal],
        "lane_stats": level["figures"]["lane_stats"], "runtime_counters": level["figures"]["counters"],
        "loadavg": loadavg(), "per_client": clients, "per_session": rows,
    }


def merge_rounds(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level's row from its runs' rows (one run: that row): tokens, seconds and turn checks
    summed, rates over the sums, the worst ITL p99; the first run's detail (per client, per
    session, lanes), and each run's own figures under `rounds`."""
    first = rows[0]
    if len(rows) == 1:
        return first
    tokens, seconds = sum(r["completion_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    steady_tokens, steady_seconds = sum(r["steady_tokens"] for r in rows), sum(r["steady_seconds"] for r in rows)
    checked = sum(r["equal_to_solo"]["checked"] for r in rows)
    itl = {c: _r(max(r["itl_p99_ms"][c] for r in rows)) for c in first["itl_p99_ms"]}
    return {**first, "turns": sum(r["turns"] for r in rows), "completion_tokens": tokens, "seconds": _r(seconds),
            "aggregate_tps": _r(tokens / seconds), "steady_seconds": _r(steady_seconds), "steady_tokens": steady_tokens,
            "steady_tps": _r(steady_tokens / steady_seconds) if steady_seconds else None,
            "drafted": sum(r["drafted"] for r in rows), "accepted": sum(r["accepted"] for r in rows),
            "itl_p99_ms": itl, "itl_p99_ms_max": _r(max(itl.values())),
            "reference": first["reference"],
            "equal_to_solo": {"checked": checked, "equal": sum(r["equal_to_solo"]["equal"] for r in rows)},
            "mismatches": [m for r in rows for m in r["mismatches"]],
            "rounds": [{key: r[key] for key in ("seconds", "completion_tokens", "aggregate_tps", "steady_seconds",
                                                "steady_tps", "tokens_per_pass", "itl_p99_ms_max", "equal_to_solo")}
                       | {"pass_ms": r["lane_stats"]["pass_ms"], "replies_per_pass": r["lane_stats"]["replies_per_pass"]}
                       for r in rows]}
