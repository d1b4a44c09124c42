"""One submitted reply as the worker and its client share it: the request, its events, its clocks.

`TurnRequest` is what an API layer (or MCP) hands the runtime; `Turn` is what it gets back: a
channel of events the worker fills (a `Delta` per verify pass, then the `Completion`), the cancel
flag a disconnect sets, and the clocks telemetry reads. The worker side lives in
`serve.scheduler`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agentfold.engine.decode import Completion, Delta, Generation, GenerationConfig, PassRequest

Event = Delta | Completion
Hook = Callable[["Turn"], None]


class TurnCancelled(Exception):
    """The turn was cancelled (its client went away) before it finished."""


@dataclass
class TurnRequest:
    """Everything the worker needs to run one reply, independent of the API it came from.

    `cache` and `cuts` are for a session layer (`Runtime.before_turn`) to fill: a restored cache
    holding a prefix of `prompt`, and extra prefill boundaries. Grammar-constrained decoding
    rides in `config.grammar`.
    """

    prompt: list[int]
    config: GenerationConfig
    api: str = "chat"  # chat | completions | responses | messages | mcp
    client: str = ""  # User-Agent, for telemetry
    session_id: str | None = None
    audit: bool = False
    model: str = ""  # the name the client asked for
    cache: Any = None  # agentfold.engine.mlx.backend.CacheState restored by a session hook, or None
    cuts: tuple[int, ...] = ()
    head: int = 0  # where the prompt's shared head (leading system messages and tools) ends: a cut too
    on_prefill: Callable[[Any], None] | None = None  # called after each prefill chunk (session snapshots)
    outcome_follows: bool = False  # an API layer calls `after_response` with the parsed outcome
    internal: bool = False  # the server's own turn (an audit replay): no session, no telemetry row
    max_tokens_clamped: dict[str, int] | None = None  # requested / granted when the context cut max_tokens


class _Closed:
    """Terminal marker on a turn's channel."""


_CLOSED = _Closed()


class Turn:
    """One submitted request: its events, its cancel flag and its clocks.

    Consume with `async for event in turn.events()` (Delta per verify pass, then the Completion),
    or `turn.result()` from a thread without an event loop. The session layer keeps its restore
    in `session`, the service its telemetry row in `record`; the API layer sets `finish_reason`
    and `tool_calls` once the reply is parsed.
    """

    _ids = itertools.count(1)

    def __init__(self, request: TurnRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request = request
        self.id = f"turn-{uuid.uuid4().hex[:16]}"
        self.seq = next(Turn._ids)
        self.submitted_at = time.perf_counter()
        self.submitted_wall = time.time()
        self.admitted_at: float | None = None
        self.first_delta_at: float | None = None
        self.finished_at: float | None = None
        self.generation: Generation | None = None
        self.completion: Completion | None = None
        self.error: BaseException | None = None
        self.status = "queued"  # queued | running | auditing | done | cancelled | failed
        self.audit = "skipped"  # skipped | passed | failed
        self.mismatch_position: int | None = None
        self.session: Any = None  # what the session layer restored (sessions.manager.PreparedTurn)
        self.record: Any = None  # the telemetry row (agentfold.serve.telemetry.TurnRecord) once built
        self.finish_reason: str | None = None  # the API-level outcome: stop | length | tool_calls
        self.tool_calls = 0
        self.passes = 0  # verify passes the worker ran for this turn
        self.prefill_passes = 0  # prefill chunks, each scheduled like a verify pass
        self.passes_at_cancel: int | None = None  # `passes` when cancel() was first called
        self._cancel = threading.Event()
        self._iter: Iterator[Delta | PassRequest] | None = None  # the generation's raw steps
        self._pending: PassRequest | None = None  # the verify pass it waits for, in this round
        self.lane_passes: list[tuple[int, int]] = []  # (replies, rows) of each pass that held one of its passes
        self._audit_generation: Generation | None = None
        self._audit_iter: Iterator[Delta] | None = None
        self._loop = loop
        self._aqueue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._squeue: queue.Queue | None = queue.Queue() if loop is None else None

    # -- clocks -------------------------------------------------------------------------------
    @property
    def queue_seconds(self) -> float:
        """Time spent waiting for a free slot (0 until admitted)."""
        return (self.admitted_at - self.submitted_at) if self.admitted_at is not None else 0.0

    @property
    def ttft_seconds(self) -> float | None:
        """Submission to the first committed tokens, queueing included."""
        return None if self.first_delta_at is None else self.first_delta_at - self.submitted_at

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the worker to drop this turn before its next verify pass (idempotent, any thread)."""
        if not self._cancel.is_set():
            self.passes_at_cancel = self.passes
        self._cancel.set()

    # -- delivery (worker side) -----------------------------------------------------------------
    def _put(self, item: Any) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._cancel.set()
        else:
            self._squeue.put(item)

    # -- consumption ----------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Deltas as they are committed, then the Completion.

        Raises `TurnCancelled` if the turn was dropped and the worker's exception if it failed.
        If the consumer stops early (its client disconnected), the turn is cancelled.
        """
        if self._aqueue is None:
            raise RuntimeError("this turn was submitted without an event loop; use result()")
        finished = False
        try:
            while True:
                item = await self._aqueue.get()
                if item is _CLOSED:
                    finished = True
                    self._raise_if_failed()
                    return
                yield item
        finally:
            if not finished:
                self.cancel()

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the turn ends (for callers without an event loop); returns the Completion."""
        if self._squeue is None:
            raise RuntimeError("this turn belongs to an event loop; use events()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self._squeue.get(timeout=left)
            if item is _CLOSED:
                self._raise_if_failed()
                assert self.completion is not None
                return self.completion

    def _raise_if_failed(self) -> None:
        if self.status == "cancelled":
            raise TurnCancelled(self.id)
        if self.error is not None:
            raise self.error
