"""Conversations by id, served from stored snapshots without changing a byte (DESIGN contract 2).

The prefill plan is what makes a resumed reply equal a fresh one. Every prompt, fresh or resumed,
is prefilled in chunks cut at absolute multiples of the engine's chunk size and at the start of
each assistant message, including the one about to be generated. A snapshot is stored where the
prompt's last cut falls (the start of the reply), and is only restored where a fresh prefill of
the new prompt would also stop, after the same chunks. The next turn's prompt is the previous one
plus that reply and a new message, so it restores the state at the start of the previous reply
and prefills exactly the chunks a fresh prefill computes from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.engine.protocol import CacheState
from agentfold.sessions.ids import check_session_id
from agentfold.sessions.snapshots import (
    DEFAULT_BUDGET,
    DEFAULT_HOT_BYTES,
    LAYOUT_VERSION,
    SnapshotError,
    SnapshotStore,
    StagedSnapshot,
)

log = logging.getLogger(__name__)

PLAN_VERSION = 2  # chunk grid + the prompt head + assistant-message starts; bump when the plan changes
HEAD_ROLES = ("system", "developer")
HEAD_MIN_TOKENS = 128  # a shorter head prefills in about a second: not worth a snapshot of its own

Message = dict[str, Any]


@dataclass
class TurnInfo:
    """What the cache did for one reply (the sessions part of the telemetry row)."""

    session_id: str
    turn_index: int
    prompt_tokens: int
    cached_tokens: int  # tokens restored from a snapshot, not prefilled
    snapshot_id: str | None  # the snapshot restored, if any
    saved_snapshot_id: str | None  # the state at the prompt's last cut, for the next turn
    cuts: list[int] = field(default_factory=list)
    miss_reasons: list[str] = field(default_factory=list)  # why a (longer) prefix was not reused
    restore_seconds: float = 0.0
    head_tokens: int = 0  # of `cached_tokens`, those restored from a prompt head any conversation shares
    head_snapshot_id: str | None = None  # the head snapshot this turn stored, if it prefilled the head


def snapshot_key(engine: Engine) -> str:
    """sha256 over everything that changes a cache's bytes: weights, config, dtype / quantization,
    tokenizer and chat template, cache layout, attention kernels, prefill plan and chunk size."""
    loaded = engine.backend.loaded
    tokenizer = engine.tokenizer
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = {
        "weights": loaded.fingerprint,
        "config": loaded.config,
        "dtype": loaded.dtype,
        "quantization": loaded.config.get("quantization"),
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "layout": LAYOUT_VERSION,
        "backend": engine.backend.name,
        "kernels": engine.backend.describe(),
        "plan": (PLAN_VERSION, engine.chunk_size),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def prompt_head(encode_head: Callable[[Sequence[Message]], list[int]], messages: Sequence[Message],
                prompt: Sequence[int]) -> int:
    """Where the prompt's head ends: its leading system / developer messages and the tool
    declarations the template renders with them; 0 when the prompt has none.

    Every new conversation of one client in one folder opens with the same head (Claude Code's
    system prompt and tools are ~11K tokens of a ~12K first turn, Codex's developer messages and
    tools ~5K of ~6K), so the head is a cut of the plan and its cache is kept as a snapshot any
    conversation that starts with the same tokens restores (`PreparedTurn.snapshot_at_reply`).
    Only the leading messages count: a later system message (Claude Code's environment) is part of
    the conversation. A head under HEAD_MIN_TOKENS is none.
    """
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in HEAD_ROLES:
        lead += 1
    if lead == 0 or lead == len(messages):
        return 0  # no system message leads, or nothing follows them
    try:
        head = encode_head(messages[:lead])
    except Exception:  # noqa: BLE001  (a template may refuse a prefix: no head)
        return 0
    if HEAD_MIN_TOKENS <= len(head) < len(prompt) and list(prompt[: len(head)]) == head:
        return len(head)
    return 0


def assistant_cuts(encode_head: Callable[[Sequence[Message]], list[int]], messages: Sequence[Message],
                   prompt: Sequence[int]) -> list[int]:
    """The plan's cuts of `prompt` alone (`prompt_cuts` without the head's position)."""
    return prompt_cuts(encode_head, messages, prompt)[0]


def prompt_cuts(encode_head: Callable[[Sequence[Message]], list[int]], messages: Sequence[Message],
                prompt: Sequence[int]) -> tuple[list[int], int]:
    """Prefill cuts where the prompt's head ends (`prompt_head`, also returned: 0 for none), where
    each assistant message starts and where this prompt's reply starts.

    `encode_head(messages[:i])` renders a prefix without the generation prompt; a cut is kept
    only where that rendering is also a token prefix of `prompt`. A resumed turn restores the
    snapshot taken where the previous reply began (a new conversation, the one taken where the
    shared head ends), so fresh and resumed prefills pass through the same chunk boundaries and
    give the same bytes (DESIGN contract 2).
    """
    starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    cuts = []
    for i in [*starts, len(messages)]:
        try:
            head = encode_head(messages[:i])
        except Exception:  # noqa: BLE001  (a template may refuse a prefix: no cut there)
            continue
        if 0 < len(head) < len(prompt) and list(prompt[: len(head)]) == head:
            cuts.append(len(head))
    head = prompt_head(encode_head, messages, prompt)
    return sorted(set(cuts) | ({head} if head else set())), head


def reply_start(plan: Sequence[int], cuts: Sequence[int]) -> int:
    """Where this prompt's snapshot is taken: the last message cut on the plan (the reply's start).

    Not the plan's last boundary: a chunk-grid point can fall after the reply's start, inside a
    server-side instruction turn or the generation prompt, which the next turn's prompt lacks.
    """
    boundaries = set(plan)
    on_plan = [c for c in cuts if c in boundaries]
    return max(on_plan) if on_plan else (plan[-1] if plan else 0)


@dataclass
class PreparedTurn:
    """A turn restored from its longest usable snapshot, ready for the engine to prefill and decode.

    Pass `snapshot_at_reply` to the engine as `on_prefill`: it stores the cache once the prefill
    reaches `head` (the end of the prompt's shared head, `prompt_head`), the state a new
    conversation with the same head restores, and once it reaches `target` (the start of this
    reply), the state the next turn restores.
    """

    prompt: list[int]
    cuts: list[int]
    cache: CacheState
    session_id: str
    cached: int
    used: str | None
    saved: str | None
    reasons: list[str]
    restore_seconds: float
    target: int = 0  # `reply_start`: where this reply starts and its snapshot is taken
    boundaries: list[int] = field(default_factory=list)  # the plan's cuts before `target`
    save: Callable[[CacheState, list[int], str | None, list[str]], str | None] | None = None
    head: int = 0  # `prompt_head`: where the shared head ends (a cut of the plan), 0 for none
    head_saved: str | None = None  # the head snapshot stored by this turn

    @property
    def head_tokens(self) -> int:
        """Tokens restored from a shared head's snapshot (not from this conversation's own)."""
        return self.cached if self.head and self.cached == self.head else 0

    def snapshot_at_reply(self, cache: CacheState) -> None:
        if self.save is None:
            return
        if self.cached < self.head == cache.length < self.target and self.head_saved is None:
            self.head_saved = self.save(cache, [b for b in self.boundaries if b < self.head], None, self.reasons)
        if cache.length == self.target and self.saved is None:
            self.saved = self.save(cache, self.boundaries, self.used, self.reasons)

    def snapshot_prefilled(self, cache: CacheState) -> str | None:
        """Store a prefill stopped short of the reply (its client went away) where it stands, when that
        is a boundary of the plan past the restored prefix: the same state a fresh prefill reaches
        there, so a retry of the request restores it and still equals a fresh reply."""
        if self.save is None or not self.cached < cache.length < self.target or cache.length not in self.boundaries:
            return None
        return self.save(cache, [b for b in self.boundaries if b < cache.length], self.used, self.reasons)


class SessionManager:
    """Replies to message lists, resuming from the longest usable stored snapshot."""

    def __init__(self, engine: Engine, home: str | Path | None = None, budget_bytes: int | None = DEFAULT_BUDGET,
                 hot_bytes: int = DEFAULT_HOT_BYTES) -> None:
        self.engine = engine
        self.store = SnapshotStore(home, budget_bytes, hot_bytes)
        self.index = self.store.index  # sessions and turns; the same class `agentfold sessions` uses
        self.key = snapshot_key(engine)
        self._lock = threading.Lock()  # one reply at a time: the engine is not reentrant
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentfold-snapshots")
        self._writes: list[Future] = []  # staged snapshots being written, oldest first

    # --- prompts and plans ---

    def _encode(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        text = self.engine.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: Sequence[Message]) -> tuple[list[int], list[int], int]:
        """Prompt ids, the plan's cuts and where the shared head ends (see `prompt_cuts`)."""
        prompt = self._encode(messages, True)
        return prompt, *prompt_cuts(lambda head: self._encode(head, False), messages, prompt)

    # --- replies ---

    def reply(self, request: Sequence[Message] | Sequence[int], config: GenerationConfig | None = None,
              session_id: str | None = None, cuts: Sequence[int] = (), head: int = 0) -> tuple[Completion, TurnInfo]:
        """Answer a message list (or prompt ids with optional `cuts` and `head`) within a session.

        Same bytes as a fresh manager with an empty store; only the prefill work differs.
        """
        with self._lock:
            prepared = self.restore(request, session_id, cuts, head)
            completion = self.engine.generate(prepared.prompt, config or GenerationConfig(), prepared.cache,
                                              prepared.cuts, on_prefill=prepared.snapshot_at_reply)
            info = self.finish(prepared, completion)
            self.flush()  # on return, this turn's snapshot is on disk
            return completion, info

    def restore(self, request: Sequence[Message] | Sequence[int], session_id: str | None = None,
                cuts: Sequence[int] = (), head: int = 0) -> PreparedTurn:
        """The longest usable snapshot of this prompt, restored; the engine prefills the rest.

        The caller streams from `prepared.cache` with `prepared.cuts` and
        `on_prefill=prepared.snapshot_at_reply`, then calls `finish`. Split this way, a
        scheduler runs the prefill chunks as passes between other replies' passes.
        """
        if request and isinstance(request[0], dict):
            prompt, cuts, head = self.render(request)  # type: ignore[arg-type]
            title = next((str(m.get("content", ""))[:60] for m in request if m.get("role") == "user"), "")
        else:
            prompt, cuts, title = [int(t) for t in request], sorted(set(cuts)), ""
        if not prompt:
            raise ValueError("the prompt is empty")
        session_id = self._ensure_session(session_id, title)
        started = time.perf_counter()
        self.flush()  # a snapshot still being written may be the one this prompt resumes from
        plan = self.engine.plan(0, len(prompt) - 1, cuts)  # where a fresh prefill stops
        cache, used, reasons = self._restore(prompt, plan, session_id)
        target = reply_start(plan, cuts)
        saved = used if used and cache.length == target else None
        head = head if head in plan and head < target else 0  # a head off the plan is none
        return PreparedTurn(prompt, list(cuts), cache, session_id, cache.length, used, saved, reasons,
                            time.perf_counter() - started, target, [b for b in plan if b < target], self._save,
                            head)

    def finish(self, prepared: PreparedTurn, completion: Completion) -> TurnInfo:
        """Record the turn and fold the restore time (before the engine started) into its stats."""
        stats = completion.stats
        stats.ttft_seconds += prepared.restore_seconds
        stats.total_seconds += prepared.restore_seconds
        index = self._record(prepared.session_id, len(prepared.prompt), len(completion.tokens),
                             prepared.saved or prepared.used)
        return TurnInfo(prepared.session_id, index, len(prepared.prompt), prepared.cached, prepared.used,
                        prepared.saved, prepared.cuts, prepared.reasons, prepared.restore_seconds,
                        prepared.head_tokens, prepared.head_saved)

    def _restore(self, prompt: list[int], plan: list[int], session_id: str) -> tuple[CacheState, str | None, list[str]]:
        """The longest verified snapshot on this plan (this session's first), or an empty cache."""
        rows, other_key = self.store.candidates(self.key, prompt, plan)
        mine = {t["snapshot_id"] for t in self.turns(session_id)}
        rows.sort(key=lambda r: (r["token_count"], r["id"] in mine, r["last_used"]), reverse=True)
        reasons: list[str] = []
        for row in rows:
            try:
                cache = self.store.load(row, self.engine.backend)
            except SnapshotError as error:
                log.warning("%s: dropped, prefilling instead", error)
                reasons.append(str(error))
                self.store.remove(row["id"])
                continue
            if other_key > cache.length:
                reasons.append(f"key mismatch: a {other_key}-token prefix is stored for another model setup")
            return cache, row["id"], reasons
        if other_key:
            reasons.append(f"key mismatch: a {other_key}-token prefix is stored for another model setup")
        elif not reasons:
            reasons.append("no stored prefix on this plan")
        return self.engine.backend.new_cache(), None, reasons

    def _save(self, cache: CacheState, boundaries: list[int], parent: str | None, reasons: list[str]) -> str | None:
        """Snapshot `cache`: its arrays are copied now, the file is written on the writer thread.

        The copy takes milliseconds; serializing, checksumming and fsyncing a 6K-token cache takes
        about a second on 2 cores, which would otherwise sit in the reply's time to first token.
        """
        try:
            staged = self.store.stage(self.key, cache, boundaries, parent, backend=self.engine.backend)
        except Exception as error:  # noqa: BLE001  (a cache layout the store cannot hold: prefill next time)
            self._not_saved(error, reasons)
            return None
        if isinstance(staged, str):
            return staged
        keep = {staged.snapshot_id} | ({parent} if parent else set())
        self._writes.append(self._writer.submit(self._write, staged, keep))
        return staged.snapshot_id

    def _write(self, staged: StagedSnapshot, keep: set[str]) -> None:
        try:
            staged.write()
        except Exception as error:  # noqa: BLE001  (disk full, read-only: the next turn prefills instead)
            self._not_saved(error, [])
            return
        try:
            self.store.evict(keep=keep)
        except Exception:  # noqa: BLE001  (eviction retries after the next write; never fail a turn for it)
            log.exception("snapshot eviction failed")

    def _not_saved(self, error: BaseException, reasons: list[str]) -> None:
        try:
            free = f"{shutil.disk_usage(self.store.dir).free / 1e6:.1f} MB free in {self.store.dir}"
        except OSError:
            free = f"{self.store.dir} unreadable"
        log.warning("snapshot not saved (%s; %s): the next turn prefills instead", error, free)
        reasons.append(f"not saved: {error}")

    def flush(self) -> None:
        """Wait until every snapshot staged so far is written (or has failed, with its warning)."""
        while self._writes:
            self._writes.pop(0).result()

    # --- sessions ---

    def _ensure_session(self, session_id: str | None, title: str) -> str:
        if session_id is not None and self.index.has_session(session_id):
            return session_id
        return self.new_session(title, session_id=session_id)

    def new_session(self, title: str = "", parent: str | None = None, session_id: str | None = None) -> str:
        session_id = check_session_id(session_id) if session_id is not None else uuid.uuid4().hex
        return self.index.new_session(session_id, title, parent)

    def _record(self, session_id: str, prompt_tokens: int, reply_tokens: int, snapshot_id: str | None) -> int:
        return self.index.record_turn(session_id, prompt_tokens, reply_tokens, snapshot_id)

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self.index.turns(session_id)

    def fork(self, session_id: str, turn: int) -> str:
        """A new session holding turns 0..`turn` of `session_id`; both share those snapshots."""
        return self.index.fork(session_id, turn)

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """A pinned session's snapshots are never evicted."""
        self.index.pin(session_id, pinned)

    def pin_snapshot(self, snapshot_id: str, pinned: bool = True) -> None:
        self.index.pin_snapshot(snapshot_id, pinned)

    def delete(self, session_id: str) -> list[str]:
        """Delete a session and its turns, and the snapshots no other turn uses (not pinned ones)."""
        return [row["id"] for row in self.index.delete(session_id)]

    def list_sessions(self) -> list[dict[str, Any]]:
        """Sessions, most recently used first, with their turn count and snapshot bytes."""
        return self.index.list_sessions()

    def list_snapshots(self) -> list[dict[str, Any]]:
        """Snapshots, most recently used first, with how many sessions and turns name each."""
        return self.index.list_snapshots()
