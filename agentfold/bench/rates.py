"""One way to turn token arrival times into a decode rate, for every engine a bench compares.

Comparisons between AgentFold (serial or drafted), mlx-lm, llama.cpp and transformers are fair
only if each rate is counted the same way: tokens after the first pass over the time after it
(`steady_tps`), so a drafted first pass that commits several tokens at once is not credited with
tokens made before the decode clock started. The engine's completions become one row shape here
(`completion_row`), and replies are compared by one hash (`token_sha`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def rounded(value: float | None, digits: int = 3) -> float | None:
    """`value` rounded to `digits`, None kept."""
    return None if value is None else round(float(value), digits)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 4 digits, None when either is missing or zero."""
    return round(a / b, 4) if a and b else None


def steady_tps(times: Sequence[float], first_burst: int) -> float | None:
    """Tokens after the first pass over the time after it: (n - b) / (t_last - t_b), b = first pass's tokens.

    For serial decoding b = 1 and this is (n - 1) / (t_last - t_first), DecodeStats' rate. A drafted
    first pass can commit several tokens at once; counting them as DecodeStats does would credit
    drafting with tokens made before the decode clock started.
    """
    if len(times) <= first_burst:
        return None
    span = times[-1] - times[first_burst - 1]
    return (len(times) - first_burst) / span if span > 0 else None


def reply_tps(completion: Any) -> float | None:
    """Tokens over the reply's time after its prefill, the first pass included: the fair rate where
    a prediction lets the first pass commit most of a reply (`steady_tps` would leave it out)."""
    stats = completion.stats
    seconds = stats.total_seconds - stats.prefill_seconds
    return stats.completion_tokens / seconds if seconds > 0 and stats.completion_tokens else None


def token_sha(tokens: Sequence[int]) -> str:
    """The engine's hash of a reply's token ids (equal ids, equal hash, whichever engine made them)."""
    from agentfold.engine.decode import token_sha as engine_token_sha

    return engine_token_sha(tokens)


def completion_row(completion: Any) -> dict[str, Any]:
    """An engine completion as a bench row: rates (steady and as DecodeStats has it), times, drafting counts."""
    stats = completion.stats
    times = stats.emit_times
    first_pass = sum(1 for t in times if t == times[0]) if times else 0
    return {
        "completion_tokens": stats.completion_tokens,
        "finish_reason": completion.finish_reason,
        "steady_tps": rounded(steady_tps(times, first_pass)),
        "decode_tps": rounded(stats.decode_tps),  # as DecodeStats reports it
        "reply_tps": rounded(reply_tps(completion)),
        "prefill_seconds": rounded(stats.prefill_seconds, 4),
        "ttft_seconds": rounded(stats.ttft_seconds, 4),
        "decode_seconds": rounded(stats.decode_seconds, 4),
        "total_seconds": rounded(stats.total_seconds, 4),
        "draft_method": stats.draft_method,
        "verify_passes": stats.verify_passes,
        "tokens_per_pass": rounded(stats.tokens_per_pass, 4),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": rounded(stats.acceptance_rate, 4),
        "proposed_per_position": list(stats.proposed_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "first_pass_tokens": first_pass,  # counted by DecodeStats.decode_tps, made before its clock starts
        "token_sha": completion.token_sha,
        "text_head": completion.text[:240],
    }
