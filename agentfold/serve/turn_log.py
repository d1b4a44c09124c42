"""One greppable log line per finished turn, and progress lines during a long prefill.

`agentfold serve` logs at INFO by default, so an operator watching the terminal sees every turn
(`turn messages session=abc prompt=10234 cached=10011 head=9876 reply=57 ttft=812ms 23.4 tok/s drafted=40
accepted=31 finish=tool_use`) and, while a long prompt is prefilled, a line every few seconds
(`prefill session=abc 4096/10234 tokens 310 tok/s`), so a long prefill does not look like a hang.
The figures are the turn's `TurnRecord`: the same numbers as the response, SQLite and /metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agentfold.serve.telemetry import TurnRecord

log = logging.getLogger(__name__)

PREFILL_LOG_SECONDS = 3.0  # a progress line at most this often during one prefill


def turn_line(record: TurnRecord) -> str:
    """The one-line summary of a finished turn (key=value, no spaces inside a value)."""
    line = (f"turn {record.api} session={record.session_id or '-'} prompt={record.prompt_tokens} "
            f"cached={record.cached_tokens} head={record.head_tokens} reply={record.completion_tokens} ttft={record.ttft_ms:.0f}ms "
            f"{record.decode_tps:.1f} tok/s drafted={record.drafted} accepted={record.accepted} "
            f"finish={record.finish_reason}")
    if record.status != "ok":
        line += f" status={record.status}"
    if record.audit != "skipped":
        line += f" audit={record.audit}"
    return line


def log_turn(record: TurnRecord) -> None:
    """Log `turn_line(record)` at INFO; never raises (a log line must not cost a reply)."""
    try:
        log.info("%s", turn_line(record))
    except Exception:
        log.exception("could not log turn %s", getattr(record, "turn_id", "?"))


class PrefillProgress:
    """An engine `on_prefill(cache)` observer that logs progress every `every_seconds`.

    Wraps the observer already there (the session layer's snapshot hook) and calls it first.
    Nothing is logged for a prefill that ends within `every_seconds`; the rate is the tokens
    prefilled since it was created (past the `cached_tokens` restored) over the wall time since
    then (waits for other turns' passes included: it is what the client experiences).
    """

    def __init__(self, session_id: str | None, prompt_tokens: int, cached_tokens: int = 0,
                 inner: Callable[[Any], None] | None = None, every_seconds: float = PREFILL_LOG_SECONDS) -> None:
        self.session_id = session_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.inner = inner
        self.every_seconds = every_seconds
        self.started = time.perf_counter()
        self.last_logged = self.started
        self.lines = 0  # progress lines logged

    def __call__(self, cache: Any) -> None:
        if self.inner is not None:
            self.inner(cache)
        try:
            self._observe(int(cache.length))
        except Exception:  # progress must never fail the prefill
            log.exception("prefill progress failed")

    def _observe(self, length: int) -> None:
        now = time.perf_counter()
        if now - self.last_logged < self.every_seconds or length >= self.prompt_tokens - 1:
            return  # too soon, or the prefill is done (the turn line follows)
        self.last_logged = now
        self.lines += 1
        log.info("%s", prefill_line(self.session_id, length, self.prompt_tokens, length - self.cached_tokens,
                                     now - self.started))


def prefill_line(session_id: str | None, done: int, total: int, prefilled: int, seconds: float) -> str:
    """`prefill session=abc 4096/10234 tokens 310 tok/s` (the rate of `prefilled` over `seconds`)."""
    rate = prefilled / seconds if seconds > 0 else 0.0
    return f"prefill session={session_id or '-'} {done}/{total} tokens {rate:.0f} tok/s"


def watch_prefill(request: Any, every_seconds: float | None = None) -> PrefillProgress:
    """The observer to pass as `on_prefill` for a `TurnRequest` (wrapping its own `on_prefill`),
    created just before its generation starts (its restored `cache` already in place).
    `every_seconds` defaults to PREFILL_LOG_SECONDS as it is at that moment."""
    cached = request.cache.length if request.cache is not None else 0
    interval = PREFILL_LOG_SECONDS if every_seconds is None else every_seconds
    return PrefillProgress(request.session_id, len(request.prompt), cached, request.on_prefill, interval)
