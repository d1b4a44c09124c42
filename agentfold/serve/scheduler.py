"""One engine, many clients: a worker thread that interleaves generations one verify pass at a time.

The engine is single-threaded (MLX arrays, one model, caches mutated in place), so exactly one
thread ever touches it: the runtime's worker. HTTP handlers (and MCP tools) build a `TurnRequest`,
`submit` it and consume the `Turn`'s events from asyncio. Requests are admitted FIFO, at most
`max_active` at a time; the active ones are stepped round-robin, one verify pass each, so a long
reply never starves a short one and every client sees tokens while others decode. Each generation
has its own cache, so interleaving their passes cannot change a single byte of any reply (the
exact sampler depends only on the row's logits, the seed and the absolute position).

A client that goes away sets the turn's cancel flag; the worker closes that generation before its
next pass, so a dropped request stops within one verify pass.

The model-facing half of chat (the chat template, tool calls) lives in `agentfold.chat`.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentfold.engine.decode import Completion, Delta, Engine, Generation, GenerationConfig, first_mismatch
from agentfold.serve.limits import DEFAULT_MAX_QUEUE
from agentfold.serve.models import config_context_length
from agentfold.serve.turn_log import watch_prefill

log = logging.getLogger(__name__)

Event = Delta | Completion
Hook = Callable[["Turn"], None]


class TurnCancelled(Exception):
    """The turn was cancelled (its client went away) before it finished."""


class RuntimeClosed(RuntimeError):
    """The runtime is shutting down and takes no more turns."""


class RuntimeBusy(RuntimeError):
    """The wait queue is full (`max_queue`): the client should retry later (HTTP 429)."""



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
        self._iter: Iterator[Delta] | None = None
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


class Runtime:
    """Owns one engine through one worker thread; serves many clients fairly.

    Plug-in points (all called on the worker thread, so they may use the engine freely):

    - `before_turn(turn)`: before the generation is created; may set `turn.request.cache`,
      `.cuts` and `.on_prefill` (session restore) and `turn.session`.
    - `after_turn(turn)`: after the reply (and its audit) finished, before the client gets the
      Completion; `turn.completion` is set (session snapshot, telemetry row).
    - `after_response(turn)`: called by the HTTP layer (on the event loop, so keep it quick)
      once the API-level outcome is known: `turn.finish_reason` (stop | length | tool_calls) and
      `turn.tool_calls`. A hook that puts a `TurnRecord` in `turn.record` has it returned as
      the response's `timings` / `agentfold` blocks.
    - `_start(request)`: the one place a Generation is created; extend it in a subclass.

    An exception in before_turn / after_turn fails that turn only; one in after_response is
    logged and the reply still goes out.
    """

    def __init__(self, engine: Engine, model_id: str, aliases: Sequence[str] = (), max_active: int = 4,
                 context_length: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, not {max_active}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {max_queue}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.aliases = tuple(a for a in aliases if a and a != model_id)
        self.max_active = max_active
        self.max_queue = max_queue  # turns waiting for a slot beyond this are refused (RuntimeBusy)
        self.context_length = context_length or _context_length(engine)
        self.before_turn: Hook | None = None
        self.after_turn: Hook | None = None
        self.after_response: Hook | None = None
        self.counters = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0}
        self.started_at = time.time()
        self._waiting: deque[Turn] = deque()
        self._active: list[Turn] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="agentfold-runtime", daemon=True)
        self._thread.start()
        _register(self)

    # -- public -----------------------------------------------------------------------------------
    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_id, *self.aliases)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active)

    def running(self) -> list[Turn]:
        """The turns decoding now (a copy), e.g. to watch one being cancelled."""
        with self._cond:
            return list(self._active)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def full(self) -> bool:
        """True when a new turn would be refused: every slot decoding and `max_queue` turns waiting."""
        with self._cond:
            return len(self._waiting) >= self.max_queue and len(self._active) >= self.max_active

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (the template already holds any BOS it wants)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def submit(self, request: TurnRequest) -> Turn:
        """Queue a request; from a coroutine its events come through the running loop.

        Raises RuntimeBusy when `max_queue` turns already wait, RuntimeClosed when shutting down.
        """
        if not request.prompt:
            raise ValueError("the prompt is empty")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        turn = Turn(request, loop)
        with self._cond:
            if self._closing:
                raise RuntimeClosed("the runtime is shutting down")
            if len(self._waiting) >= self.max_queue and len(self._active) >= self.max_active:
                raise RuntimeBusy(f"{len(self._waiting)} requests already wait (limit {self.max_queue})")
            self._waiting.append(turn)
            self.counters["submitted"] += 1
            self._cond.notify()
        return turn

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker; turns still queued or running fail with RuntimeClosed."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is threading.current_thread():
            return
        self._thread.join(timeout)
        if not self._thread.is_alive():
            _wait_native_exit(self._thread)

    # -- worker -----------------------------------------------------------------------------------
    def _start(self, request: TurnRequest) -> Generation:
        """Create the generation for a request: the single point to extend."""
        return self.engine.stream(request.prompt, request.config, cache=request.cache, cuts=request.cuts,
                                  on_prefill=watch_prefill(request))  # the request's own observer, + progress lines

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._active and not self._waiting:
                    self._cond.wait()
                if self._closing:
                    pending = [*self._active, *self._waiting]
                    self._active.clear()
                    self._waiting.clear()
                    break
                while self._waiting and len(self._active) < self.max_active:
                    turn = self._waiting.popleft()
                    turn.admitted_at = time.perf_counter()
                    self._active.append(turn)
                batch = list(self._active)
            for turn in batch:  # round-robin: one verify pass each
                if not self._step(turn):
                    with self._cond:
                        self._active.remove(turn)
        for turn in pending:
            self._close_iterators(turn)
            self._end(turn, "failed", RuntimeClosed("the runtime is shutting down"))

    def _step(self, turn: Turn) -> bool:
        """Run one verify pass of `turn`; False once the turn has ended."""
        if turn.cancelled:
            self._close_iterators(turn)
            self._end(turn, "cancelled")
            return False
        try:
            if turn._audit_iter is not None:
                return self._step_audit(turn)
            if turn._iter is None:
                turn.status = "running"
                if self.before_turn is not None:
                    self.before_turn(turn)
                turn.generation = self._start(turn.request)
                turn._iter = iter(turn.generation)
            try:
                delta = next(turn._iter)
            except StopIteration:
                turn.completion = turn.generation.completion
                return self._after_reply(turn)
            if not delta.tokens:  # a prefill chunk: other replies get their pass before the next one
                turn.prefill_passes += 1
                return True
            turn.passes += 1
            if turn.first_delta_at is None:
                turn.first_delta_at = time.perf_counter()
            turn._put(delta)
            return True
        except Exception as error:  # a failed turn must never take the worker down
            log.exception("turn %s failed", turn.id)
            self._close_iterators(turn)
            self._end(turn, "failed", error)
            return False

    def _after_reply(self, turn: Turn) -> bool:
        completion = turn.completion
        if turn.request.audit and completion.stats.draft_method != "none":
            turn.status = "auditing"
            reference = replace(turn.request.config, draft=False)
            turn._audit_generation = self.engine.stream(turn.request.prompt, reference)
            turn._audit_iter = iter(turn._audit_generation)
            return True
        return self._complete(turn)

    def _step_audit(self, turn: Turn) -> bool:
        try:
            next(turn._audit_iter)
            return True
        except StopIteration:
            pass
        turn.mismatch_position = first_mismatch(turn.completion.tokens, turn._audit_generation.completion.tokens)
        turn.audit = "passed" if turn.mismatch_position is None else "failed"
        if turn.mismatch_position is not None:
            log.error("turn %s: drafted reply differs from serial at token %s", turn.id, turn.mismatch_position)
        turn._audit_iter = turn._audit_generation = None
        return self._complete(turn)

    def _complete(self, turn: Turn) -> bool:
        if self.after_turn is not None:
            self.after_turn(turn)
        turn._put(turn.completion)
        self._end(turn, "done")
        return False

    def _close_iterators(self, turn: Turn) -> None:
        for name in ("_iter", "_audit_iter"):
            iterator = getattr(turn, name)
            if iterator is not None and hasattr(iterator, "close"):
                try:
                    iterator.close()
                except Exception:  # closing a broken generator must not fail the worker
                    log.exception("closing turn %s", turn.id)
            setattr(turn, name, None)

    def _end(self, turn: Turn, status: str, error: BaseException | None = None) -> None:
        turn.status = status
        turn.error = error
        turn.finished_at = time.perf_counter()
        self.counters[{"done": "completed"}.get(status, status)] += 1
        turn._put(_CLOSED)


_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _close_all_at_exit() -> None:
    for runtime in list(_LIVE):
        runtime.close()


def _register(runtime: Runtime) -> None:
    global _ATEXIT_REGISTERED
    _LIVE.add(runtime)
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all_at_exit)
        _ATEXIT_REGISTERED = True


def _wait_native_exit(thread: threading.Thread, timeout: float = 5.0) -> None:
    """Wait until the OS thread is gone, not just its Python part.

    MLX keeps a thread-local compile cache (mlx-lm compiles its activations). Its destructor
    runs after `join()` returns, and needs the GIL to drop Python references; if the interpreter
    is finalizing by then, the thread is killed inside a noexcept destructor and the process
    aborts ("terminate called without an active exception", exit status 134). So the worker
    must have fully exited before the caller goes on (Linux: its /proc task entry disappears).
    """
    task = f"/proc/self/task/{thread.native_id}"
    if thread.native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.2)
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


def _context_length(engine: Engine) -> int:
    """The model's context window from its config (max_position_embeddings and friends)."""
    config = getattr(getattr(engine.backend, "loaded", None), "config", None) or {}
    return config_context_length(config) or 4096
