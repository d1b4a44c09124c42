"""One engine, many clients: a worker thread that runs every active reply's verify pass in one pass.

The engine is single-threaded (MLX arrays, one model, caches mutated in place), so exactly one
thread ever touches it: the runtime's worker. HTTP handlers (and MCP tools) build a `TurnRequest`,
`submit` it and consume the `Turn`'s events from asyncio. Requests are admitted FIFO, at most
`max_active` at a time. Each round, every active reply advances to its next step: a reply still
prefilling runs one layer of one chunk, a decoding reply proposes its drafts and asks for a
verify pass (`PassRequest`). The passes asked for are then run together as lanes of one forward
pass (`serve.lanes`: the rows of every reply share the linear layers, each attends to its own
cache, the whole pass within the self-check's row-exact width), and each reply commits its
tokens. A long reply never starves a short one, and every client sees tokens while others
decode. Each generation has its own cache and every row's arithmetic ignores the other rows, so
sharing passes cannot change a single byte of any reply (the exact sampler depends only on the
row's logits, the seed and the absolute position).

A client that goes away sets the turn's cancel flag; the worker closes that generation before its
next pass, so a dropped request stops within one verify pass.

The model-facing half of chat (the chat template, tool calls) lives in `agentfold.chat`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from agentfold.engine.decode import Engine, Generation, PassRequest, first_mismatch
from agentfold.engine.protocol import forward_lanes
from agentfold.serve.lanes import LaneStats, plan_lanes
from agentfold.serve.limits import DEFAULT_MAX_QUEUE
from agentfold.serve.models import config_context_length
from agentfold.serve.turn import _CLOSED, Event, Hook, Turn, TurnCancelled, TurnRequest
from agentfold.serve.turn_log import watch_prefill

log = logging.getLogger(__name__)

# How long the prefilling replies of a round may run layer steps, together: as long as the round's
# last shared decode pass took, and at least PREFILL_SLICE_S each. While anyone prefills, prefill
# and decode get about half the machine each: a decoding reply's inter-token gap at most doubles,
# and an agent's next turn (its last reply and a message, ~150 tokens) is back in the shared
# passes in a few rounds instead of one layer or two per round (eight SmolLM2 sessions on two
# Xeon cores: ~1 s to the first token with 20 ms slices, the session idle meanwhile).
PREFILL_SLICE_S = 0.02

__all__ = ["Event", "Hook", "Runtime", "RuntimeBusy", "RuntimeClosed", "Turn", "TurnCancelled", "TurnRequest"]


class RuntimeClosed(RuntimeError):
    """The runtime is shutting down and takes no more turns."""


class RuntimeBusy(RuntimeError):
    """The wait queue is full (`max_queue`): the client should retry later (HTTP 429)."""


class Runtime:
    """Owns one engine through one worker thread; serves many clients fairly.

    Plug-in points (all called on the worker thread, so they may use the engine freely):

    - `ready(turn)`: whether an admitted turn may start now; False keeps it waiting, asked again
      every round (a turn whose prompt head another running turn is prefilling waits for that
      head's snapshot rather than prefilling it too).
    - `before_turn(turn)`: before the generation is created; may set `turn.request.cache`,
      `.cuts` and `.on_prefill` (session restore) and `turn.session`.
    - `after_turn(turn)`: after the reply (and its audit) finished, before the client gets the
      Completion; `turn.completion` is set (session snapshot, telemetry row).
    - `after_cancel(turn)`: after a turn whose client went away was closed (its prefill stopped
      between steps); the chunks it prefilled are still in its cache (session snapshot).
    - `after_response(turn)`: called by the HTTP layer (on the event loop, so keep it quick)
      once the API-level outcome is known: `turn.finish_reason` (stop | length | tool_calls) and
      `turn.tool_calls`. A hook that puts a `TurnRecord` in `turn.record` has it returned as
      the response's `timings` / `agentfold` blocks.
    - `_start(request)`: the one place a Generation is created; extend it in a subclass.

    An exception in before_turn / after_turn fails that turn only; one in after_response is
    logged and the reply still goes out.
    """

    def __init__(self, engine: Engine, model_id: str, aliases: Sequence[str] = (), max_active: int = 4,
                 context_length: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE, lanes: bool = True) -> None:
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
        self.ready: Callable[[Turn], bool] | None = None
        self.before_turn: Hook | None = None
        self.after_turn: Hook | None = None
        self.after_cancel: Hook | None = None
        self.after_response: Hook | None = None
        self.counters = {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0}
        self.lanes = LaneStats()
        self.share_passes = lanes  # False: every reply's pass runs alone (for comparison)
        self.started_at = time.time()
        self._waiting: deque[Turn] = deque()
        self._active: list[Turn] = []
        self._cond = threading.Condition()
        self._closing = False
        self._prefilling = 0  # replies that ran prefill steps in the last round
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
                                  on_prefill=watch_prefill(request),  # the request's own observer, + progress lines
                                  prefill_in_passes=self.prompts_in_passes)

    @property
    def prompts_in_passes(self) -> bool:
        """Whether prompts are prefilled as passes, riding in the replies' shared passes (where
        the self-check found the backend's prefill row-exact at every width and lanes are on):
        the weights are read once for both, and no decoding reply waits out a prefill slice."""
        return self.lane_width >= 2 and self.engine.exactness.prefill_lanes

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
            share = max(PREFILL_SLICE_S, self.lanes.last_seconds / max(1, self._prefilling))
            steps = [turn.prefill_passes for turn in batch]
            ended = [turn for turn in batch if not self._prefill_or_ask(turn, share)]
            self._prefilling = sum(turn.prefill_passes > before for turn, before in zip(batch, steps, strict=True))
            asking = [turn for turn in batch if turn._pending is not None]
            # No reply decodes: each prompt's chunk (at most `decode.PROMPT_PASS_MAX` rows) in a pass of
            # its own; with replies decoding, prompt rows ride in their shared pass, `lanes.PROMPT_ROWS` at a time.
            if all(turn._pending.prefill for turn in asking):
                groups = [[i] for i in range(len(asking))]
            else:
                groups = plan_lanes([turn._pending for turn in asking], self.lane_width)
            for group in groups:
                group = [asking[i] for i in group]
                self._run_lanes(group)
                ended += [turn for turn in group if not self._finish_pass(turn)]
            if ended:
                with self._cond:
                    for turn in ended:
                        self._active.remove(turn)
        for turn in pending:
            self._close_iterators(turn)
            self._end(turn, "failed", RuntimeClosed("the runtime is shutting down"))

    @property
    def lane_width(self) -> int:
        """Rows one shared pass may hold: the widest pass the self-check found exact with rows of
        different sequences in it (each reply still verifies at most `max_width` rows); 0 (every
        pass alone) where it found none or lanes are off."""
        return self.engine.exactness.lane_width if self.share_passes else 0

    def _prefill_or_ask(self, turn: Turn, share: float = PREFILL_SLICE_S) -> bool:
        """Advance `turn` to its next verify pass, or run its prefill's layer steps for up to
        `share` seconds (at least one); False once the turn has ended. A long chunk's layer step
        takes the whole slice (other replies' passes run between its layers); a short chunk (a
        resumed turn's new message) is done in a round or two, not one round per layer."""
        began = time.perf_counter()
        while True:
            steps = turn.prefill_passes
            if not self._advance(turn):
                return False
            if (turn.prefill_passes == steps or time.perf_counter() - began >= share
                    or self._closing):  # a closing runtime ends turns between layer steps
                return True

    def _advance(self, turn: Turn) -> bool:
        """Run one prefill step of `turn`, or move it to its next verify pass (`turn._pending`);
        False once the turn has ended."""
        if turn.cancelled:
            self._close_iterators(turn)
            if self.after_cancel is not None:
                try:
                    self.after_cancel(turn)
                except Exception:  # a cancelled turn's bookkeeping must not take the worker down
                    log.exception("after_cancel of turn %s", turn.id)
            self._end(turn, "cancelled")
            return False
        try:
            if turn._audit_iter is not None:
                return self._step_audit(turn)
            if turn._iter is None:
                if self.ready is not None and not self.ready(turn):
                    return True  # not yet: asked again next round, while the others advance
                turn.status = "running"
                if self.before_turn is not None:
                    self.before_turn(turn)
                turn.generation = self._start(turn.request)
                turn._iter = turn.generation.steps
            try:
                item = next(turn._iter)
            except StopIteration as stop:
                turn.completion = turn.generation.completion = stop.value
                return self._after_reply(turn)
            if isinstance(item, PassRequest):
                turn._pending = item
            else:  # a prefill step: other replies get their pass before the next one
                turn.prefill_passes += 1
            return True
        except Exception as error:  # a failed turn must never take the worker down
            return self._fail(turn, error)

    def _run_lanes(self, turns: list[Turn]) -> None:
        """The pending passes of `turns` as one forward pass, each reply a lane on its own cache
        (the prompt rows of replies in prefill too, their logits not computed)."""
        requests = [turn._pending for turn in turns]
        wanted = [not request.prefill for request in requests]
        began = time.perf_counter()
        try:
            logits = forward_lanes(self.engine.backend, [(request.tokens, request.cache) for request in requests],
                                   None if all(wanted) else wanted)
        except Exception as error:
            for turn in turns:
                turn._pending = None
                self._fail(turn, error)
            return
        seconds = time.perf_counter() - began
        rows = sum(len(request.tokens) for request in requests)
        prompt_rows = sum(len(request.tokens) for request in requests if request.prefill)
        verifying = sum(wanted)
        if verifying:
            self.lanes.record(verifying, rows - prompt_rows, seconds, prompt_rows)
        for turn, request, lane_logits in zip(turns, requests, logits, strict=True):
            request.logits, request.rows, request.seconds = lane_logits, rows, seconds
            if not request.prefill:
                turn.lane_passes.append((verifying, rows))

    def _finish_pass(self, turn: Turn) -> bool:
        """Resume `turn` with its pass's logits and send the tokens it committed; False once ended.
        (A prompt's pass commits nothing: the reply's prefill goes on.)"""
        if turn._pending is None:  # its shared pass failed, and the turn with it (`_run_lanes`)
            return False
        prompt = turn._pending.prefill
        turn._pending = None
        try:
            delta = next(turn._iter)
        except Exception as error:
            return self._fail(turn, error)
        if prompt:
            turn.prefill_passes += 1
            return True
        turn.passes += 1
        if turn.first_delta_at is None:
            turn.first_delta_at = time.perf_counter()
        turn._put(delta)
        return True

    def _fail(self, turn: Turn, error: BaseException) -> bool:
        log.error("turn %s failed", turn.id, exc_info=error)
        self._close_iterators(turn)
        self._end(turn, "failed", error)
        return False

    def _after_reply(self, turn: Turn) -> bool:
        completion = turn.completion
        if turn.request.audit and completion.stats.draft_method != "none":
            turn.status = "auditing"
            reference = replace(turn.request.config, draft=False)
            turn._audit_generation = self.engine.stream(turn.request.prompt, reference, cuts=turn.request.cuts)
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
