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

This module also holds the model-facing half of chat: `render_chat` (chat template, with a
Hermes/Qwen-style tool section for templates that know nothing of tools) and `ToolCallParser`
(tool calls out of the model's text, incrementally, for streaming and non-streaming alike).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentfold.engine.decode import Completion, Delta, Engine, Generation, GenerationConfig, first_mismatch
from agentfold.serve.limits import DEFAULT_MAX_QUEUE

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
    meta: dict[str, Any] = field(default_factory=dict)  # free-form, for hooks


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
                                  on_prefill=request.on_prefill)

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
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "context_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        value = text_config.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return 4096


# ---------------------------------------------------------------------------------------------
# Chat rendering and tool calls
# ---------------------------------------------------------------------------------------------

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass
class ToolSpec:
    """A function the model may call: name, description and JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolCall:
    """A call parsed out of the model's output; `arguments` is a compact JSON object string."""

    name: str
    arguments: str
    id: str = ""

    @property
    def arguments_obj(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def tool_section(tools: Sequence[ToolSpec]) -> str:
    """The Hermes/Qwen tool instructions, for templates that do not render tools themselves."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def format_tool_call(name: str, arguments: Any) -> str:
    """An assistant tool call written the way the model is told to write one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def template_knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    return "tools" in template


def trailing_instruction(choice: str | dict[str, Any] | None, fmt: dict[str, Any] | None = None) -> str:
    """The server's instruction for a forced call (`choice`: "required" or `{"name": ...}`) or JSON
    output (`fmt`: a response_format), rendered by `render_chat(trailing=...)`; "" when none applies.
    """
    if isinstance(choice, dict):
        return (f"You must now call the function {choice['name']!r}: answer only with a <tool_call> block "
                "holding its name and JSON arguments.")
    if choice == "required":
        return "You must now call one of the provided functions: answer only with <tool_call> blocks."
    if fmt and fmt.get("type") == "json_object":
        return "Answer with a single valid JSON object and nothing else."
    if fmt and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or fmt).get("schema")
        return "Answer with a single valid JSON value matching this JSON schema, and nothing else:\n" + json.dumps(schema)
    return ""


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec | dict] | None = None,
                add_generation_prompt: bool = True, trailing: str | None = None) -> str:
    """The prompt text for `messages` (OpenAI chat shape) with the tokenizer's chat template.

    Messages: `{"role": system|user|assistant|tool, "content": str | None, "tool_calls":
    [{"id", "function": {"name", "arguments"}}], "tool_call_id"}`. Templates that mention tools
    (Qwen, Llama 3.x, ...) get them natively. Others (SmolLM2, Gemma) ignore tools and tool
    messages, so the tools are described in the system prompt, assistant calls are written as
    `<tool_call>` blocks and tool results become `<tool_response>` text in a user turn; same-role
    neighbours are merged so strictly alternating templates accept the result.

    `trailing`: a server-side instruction (forced tool call, JSON output) rendered as its own user
    turn after the conversation, never merged into it, so the conversation's rendering stays a
    prefix of this prompt and the next turn (whose history lacks the instruction) reuses its cache.
    Where a template cannot keep it apart, the instruction is merged into the last user turn.
    """
    if trailing:
        return _render_with_trailing(tokenizer, messages, tools, add_generation_prompt, trailing)
    specs = [t if isinstance(t, ToolSpec) else _spec_from_dict(t) for t in (tools or [])]
    has_tool_traffic = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not getattr(tokenizer, "chat_template", None):
        return _plain_render(_flatten(messages, specs), add_generation_prompt)
    if template_knows_tools(tokenizer) and (specs or has_tool_traffic):
        try:
            native = [_native_message(m) for m in messages]
            return tokenizer.apply_chat_template(native, tools=[t.as_openai() for t in specs] or None,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as error:  # a template that chokes on tools: fall back to our own section
            log.info("chat template rejected native tools (%s); describing them in the system prompt", error)
    flat = _flatten(messages, specs) if (specs or has_tool_traffic) else _merge([_simple(m) for m in messages])
    return tokenizer.apply_chat_template(flat, add_generation_prompt=add_generation_prompt, tokenize=False)


_SEPARATOR = "\u2063agentfold-separator\u2063"  # an assistant turn that keeps two user turns apart


def _render_with_trailing(tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec | dict] | None,
                          add_generation_prompt: bool, trailing: str) -> str:
    """The conversation's own rendering, then `trailing` as a user turn of its own.

    The instruction turn's text is cut from a rendering where a placeholder assistant turn keeps
    it apart from the last user turn; it is used only if every rendering involved is a prefix of
    the next (per-message templates: ChatML, Llama, Gemma, ...).
    """
    extra = {"role": "user", "content": trailing}
    spacer = {"role": "assistant", "content": _SEPARATOR}
    try:
        history = render_chat(tokenizer, messages, tools, add_generation_prompt=False)
        head = render_chat(tokenizer, [*messages, spacer], tools, add_generation_prompt=False)
        text = render_chat(tokenizer, [*messages, spacer, extra], tools, add_generation_prompt)
        if head.startswith(history) and text.startswith(head) and _SEPARATOR not in text[len(head):]:
            return history + text[len(head):]
    except Exception as error:  # noqa: BLE001  (a template with its own rules: merge below)
        log.info("chat template cannot render a separate instruction turn (%s); merging it", error)
    return render_chat(tokenizer, [*messages, extra], tools, add_generation_prompt)


def _spec_from_dict(tool: dict[str, Any]) -> ToolSpec:
    function = tool.get("function", tool)
    return ToolSpec(function["name"], function.get("description") or "",
                    function.get("parameters") or {"type": "object", "properties": {}})


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    return str(content)


def _simple(message: dict[str, Any]) -> dict[str, str]:
    role = message.get("role", "user")
    role = "system" if role == "developer" else role
    return {"role": role, "content": _text(message.get("content"))}


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    out = _simple(message)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {"input": arguments}
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function.get("name", ""), "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _flatten(messages: Sequence[dict[str, Any]], specs: Sequence[ToolSpec]) -> list[dict[str, str]]:
    """Messages as plain system/user/assistant text, tools described in the system prompt."""
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for message in messages:
        role = message.get("role", "user")
        text = _text(message.get("content"))
        if role in ("system", "developer"):
            if text:
                system.append(text)
        elif role == "assistant":
            parts = [text.strip()] if text.strip() else []
            for call in message.get("tool_calls") or []:
                function = call.get("function", call)
                parts.append(format_tool_call(function.get("name", ""), function.get("arguments", {})))
            turns.append({"role": "assistant", "content": "\n".join(parts)})
        elif role in ("tool", "function"):
            turns.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            turns.append({"role": "user", "content": text})
    if specs:
        system.append(tool_section(specs))
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + _merge(turns)


def _merge(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    merged: list[dict[str, str]] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] and message["role"] != "assistant":
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n" + message["content"]}
        else:
            merged.append(message)
    return merged


def _plain_render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """A ChatML rendering for tokenizers without a template."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@dataclass
class TextPiece:
    """Content text to show the user."""

    text: str


class ToolCallParser:
    """Splits model output into content text and `<tool_call>{json}</tool_call>` calls, incrementally.

    `feed(text)` returns the pieces that are settled: text that cannot be the start of a tag and
    calls whose block closed. Text before the first call is the content; after a call, only
    further calls count (several blocks = parallel calls). A block that does not parse as
    `{"name": str, "arguments": object}` is given back as text. `prefix` is output the prompt
    already forced (e.g. `<tool_call>\\n{"name": "`), parsed as if the model had written it.
    With `enabled=False` everything is text.
    """

    def __init__(self, enabled: bool = True, prefix: str = "") -> None:
        self.enabled = enabled
        self.buffer = ""
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending: list[TextPiece | ToolCall] = []
        self._pending = self.feed(prefix) if prefix else []

    def feed(self, text: str) -> list[TextPiece | ToolCall]:
        out: list[TextPiece | ToolCall] = self._pending
        self._pending = []
        if not self.enabled:
            if text:
                self.content += text
                out.append(TextPiece(text))
            return out
        self.buffer += text
        while True:
            if self.in_call:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                out.extend(self._call_or_text(body))
                continue
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                out.extend(self._text(self.buffer[:start].rstrip()))
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN)
            settled = self.buffer[: len(self.buffer) - keep]
            stripped = settled.rstrip()  # hold trailing whitespace: it may precede a call
            out.extend(self._text(stripped))
            self.buffer = self.buffer[len(stripped):]
            return out

    def finish(self) -> list[TextPiece | ToolCall]:
        """Settle what is left: an unterminated block is a call if its JSON is complete."""
        out = self.feed("")
        if self.in_call:
            self.in_call = False
            body, self.buffer = self.buffer, ""
            out.extend(self._call_or_text(body, unterminated=True))
        elif self.buffer:
            out.extend(self._text(self.buffer))
            self.buffer = ""
        return out

    def _text(self, text: str) -> list[TextPiece]:
        if self.calls:  # after a call, stray text is not content
            return []
        if not self.content:
            text = text.lstrip()
        if not text:
            return []
        self.content += text
        return [TextPiece(text)]

    def _call_or_text(self, body: str, unterminated: bool = False) -> list[TextPiece | ToolCall]:
        call = parse_tool_call(body)
        if call is not None:
            self.calls.append(call)
            return [call]
        raw = TOOL_CALL_OPEN + body + ("" if unterminated else TOOL_CALL_CLOSE)
        return self._text(raw)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_tool_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or `parameters`, or arguments as a JSON string)."""
    text = body.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(text)
    except ValueError:
        value = _first_json_object(text)
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _first_json_object(text: str) -> Any:
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return value


def parse_output(text: str, tools_enabled: bool = True, prefix: str = "") -> tuple[str, list[ToolCall]]:
    """Content and tool calls of a whole reply (the non-streaming form of ToolCallParser)."""
    parser = ToolCallParser(tools_enabled, prefix)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
