"""The decode loop: draft, verify in one pass, commit the matching prefix, roll back the rest.

Each pass holds the pending token (the last one committed, not yet in the cache) and up to k
drafts. Row j's logits choose the target's token t_j for absolute position base + j + 1 with the
exact sampler. Drafts are accepted while d_j == t_j; the first t_j that differs is committed in
place of its draft, and if every draft matched the last row's choice is committed too. The
committed tokens are exactly the ones serial decoding would have produced, whatever the drafter
proposed: drafting changes how many passes a reply takes, never the reply.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.engine.constraints import Constraint, GrammarConstraint
from agentfold.engine.depth import DepthController, DraftOdds
from agentfold.engine.detokenizer import Detokenizer, find_stop, held_back
from agentfold.engine.drafters import Drafter, PredictionDrafter
from agentfold.engine.lazy_calls import LazyCallConstraint, is_lazy
from agentfold.engine.protocol import Backend, CacheState, Checkpoint
from agentfold.engine.sampler import SamplingParams, TokenLogprob, choose, token_logprob
from agentfold.engine.selfcheck import ExactnessReport

log = logging.getLogger(__name__)

PrefillObserver = Callable[[CacheState], None]

# Where prompts run as passes (`Engine.stream(prefill_in_passes=True)`): a chunk of the plan up to this
# many rows is asked for as prefill passes (a turn's new message, a short tool result: they ride in
# the replies' shared passes), a longer one runs layer steps (a long prompt's attention costs a pass
# of 32 rows after 12K tokens ~130 ms: in the decoding replies' passes it would stretch their every
# token five-fold, where layer steps in time slices at most double it).
PROMPT_PASS_MAX = 128

# Prefill chunk of the plan (absolute multiples; part of the snapshot key). Each chunk is one
# scheduled step, so it bounds how long a long prompt keeps other replies waiting: on 2 Xeon cores
# with SmolLM2-135M, 512 tokens take 0.9 s at the start of a prompt and 2.8 s at 4K tokens, and
# prefill runs at 96% of the rate of 2048-token chunks (275 vs 287 tok/s over 4K tokens).
PREFILL_CHUNK = 512
PREDICTION_PRIOR = 0.9  # a reply's acceptance estimate at its start when the client sent a prediction


@dataclass
class GenerationConfig:
    """What one reply may be: its sampler, length, stop strings, and whether to draft."""

    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    draft: bool = True
    grammar: str | None = None  # llguidance (Lark) grammar every row follows (a lazy one: engine.lazy_calls)
    logprobs: int | None = None  # None: none; N >= 0: each token's logprob and its row's N most likely
    prediction: tuple[int, ...] = ()  # ids the client expects the reply to repeat (Predicted Outputs): drafts

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, not {self.logprobs}")


@dataclass
class DecodeStats:
    """Counters and clocks of one reply (DESIGN contract 3, the engine's part)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    first_pass_tokens: int = 0
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_method: str = "none"
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    pass_seconds: list[float] = field(default_factory=list)
    emit_times: list[float] = field(default_factory=list)  # seconds since start, per token
    offload: dict[str, Any] | None = None  # MoE expert offload counters of this reply (engine.offload)

    @property
    def discarded(self) -> int:
        return self.drafted - self.accepted

    @property
    def tokens_per_pass(self) -> float:
        return self.completion_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def prediction_tokens(self) -> dict[str, int]:
        """Predicted Outputs' counts as OpenAI names them: the prediction's drafts the verify passes
        kept and those they threw away; zeros where the reply drafted from no prediction."""
        predicted = self.draft_method == "prediction"
        return {"accepted_prediction_tokens": self.accepted if predicted else 0,
                "rejected_prediction_tokens": self.drafted - self.accepted if predicted else 0}

    @property
    def decode_tps(self) -> float:
        """Tokens committed after the first pass over the time after it (llama.cpp's predicted rate)."""
        later = self.completion_tokens - self.first_pass_tokens
        if later < 1 or self.decode_seconds <= 0:
            return 0.0
        return later / self.decode_seconds

    def record_position(self, position: int, accepted: bool) -> None:
        while len(self.proposed_per_position) <= position:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        self.proposed_per_position[position] += 1
        self.accepted_per_position[position] += int(accepted)


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str  # stop | length
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None  # one per token when the config asked (config.logprobs)

    @property
    def token_sha(self) -> str:
        return token_sha(self.tokens)


def token_sha(tokens: Sequence[int]) -> str:
    """sha256 of the token ids (little-endian int32): the fingerprint audits compare."""
    return hashlib.sha256(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)).hexdigest()


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None when equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class Delta:
    """Newly committed tokens and the text they completed (and their logprobs, when asked)."""

    tokens: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass
class PassRequest:
    """A verify pass a reply asks for: its pending token and drafts, appended to its cache.

    The generation yields it and waits. Whoever drives the generation runs it, alone
    (`Generation`) or as one lane of a pass shared with other replies (the server's scheduler),
    sets `logits` (one row per token) and resumes the generation. A driver may first cut `tokens`
    to a shorter prefix (never below the pending token) to keep a shared pass within the
    row-exact width; the reply then verifies only the drafts that ran. `rows` and `seconds`
    describe the whole pass (every lane's rows), for the depth controller's cost model.

    A `prefill` request holds prompt rows instead (`Engine.stream(prefill_in_passes=True)`): no
    logits are wanted, and a driver may run any non-empty prefix of its tokens, in a pass of its
    own or as a lane of a shared decode pass (the generation asks again for the rest). It exists
    only where the backend's prefill is row-exact at every width (`ExactnessReport.prefill_lanes`),
    so where a prompt is cut, and what shares its passes, change no bit of the cache.
    """

    tokens: list[int]
    cache: CacheState
    logits: Any = None
    rows: int = 0
    seconds: float = 0.0
    prefill: bool = False

    def run_alone(self, backend: Backend) -> None:
        began = time.perf_counter()
        if self.prefill:
            for _ in backend.prefill_steps(self.tokens, self.cache):
                pass
        else:
            self.logits = backend.forward(self.tokens, self.cache)
        self.rows, self.seconds = len(self.tokens), time.perf_counter() - began


class Generation:
    """Iterate for `Delta`s; `completion` is set once the reply is finished.

    Iterating runs each verify pass alone on `backend`. `steps` is the raw generator, for a
    driver that runs the `PassRequest`s it yields itself (several replies' passes in one).
    """

    def __init__(self, steps: Iterator[Delta | PassRequest], backend: Backend) -> None:
        self.steps = steps
        self.backend = backend
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[Delta]:
        try:
            while True:
                try:
                    item = next(self.steps)
                except StopIteration as stop:
                    self.completion = stop.value
                    return
                if isinstance(item, PassRequest):
                    item.run_alone(self.backend)
                else:
                    yield item
        finally:  # closed early (a cancelled reply): close the reply's own generator too
            if self.completion is None:
                self.steps.close()

    def run(self) -> Completion:
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion


class Engine:
    """One model, one drafter, and the loop that makes drafting exact."""

    def __init__(
        self,
        backend: Backend,
        tokenizer,
        eos_token_ids: set[int],
        drafter: Drafter | None = None,
        exactness: ExactnessReport | None = None,
        chunk_size: int = PREFILL_CHUNK,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.drafter = drafter
        self.exactness = exactness or ExactnessReport(max_width=1)
        self.chunk_size = chunk_size
        self.controller = DepthController(max_depth=max(0, self.exactness.max_width - 1))
        self.controller.seed_costs(self.exactness.pass_seconds)

    @property
    def max_drafts(self) -> int:
        return self.controller.max_depth if self.drafter is not None else 0

    def plan(self, start: int, end: int, cuts: Sequence[int] = ()) -> list[int]:
        """Prefill chunk boundaries in (start, end): absolute multiples of chunk_size, plus `cuts`."""
        first = (start // self.chunk_size + 1) * self.chunk_size
        grid = range(first, end, self.chunk_size)
        return sorted({*grid, *(c for c in cuts if start < c < end)})

    def generate(self, prompt: Sequence[int], config: GenerationConfig, cache: CacheState | None = None,
                 cuts: Sequence[int] = (), on_prefill: PrefillObserver | None = None) -> Completion:
        return self.stream(prompt, config, cache, cuts, on_prefill).run()

    def stream(self, prompt: Sequence[int], config: GenerationConfig, cache: CacheState | None = None,
               cuts: Sequence[int] = (), on_prefill: PrefillObserver | None = None,
               prefill_in_passes: bool = False) -> Generation:
        """The reply as a generation: one empty `Delta` per prefill step, then one per verify pass.

        A prefill step is one layer of one chunk of the plan, so a scheduler can run other
        replies' passes between the steps of a long prompt and none waits more than a layer's
        share of a chunk. With `prefill_in_passes` (where `exactness.prefill_lanes` holds), a
        step is a prefill `PassRequest` instead, for the driver to run alone or in a shared pass,
        followed by an empty `Delta`. `on_prefill(cache)` is called after every chunk of the plan
        (the session layer snapshots the cache where the reply starts).
        """
        in_passes = prefill_in_passes and self.exactness.prefill_lanes
        return Generation(self._decode(prompt, config, cache, cuts, on_prefill, in_passes), self.backend)

    def _decode(self, prompt: Sequence[int], config: GenerationConfig, cache: CacheState | None,
                cuts: Sequence[int], on_prefill: PrefillObserver | None = None,
                prefill_in_passes: bool = False) -> Iterator[Delta | PassRequest]:
        """Prefill the rest of the prompt chunk by chunk, then pass after pass until the reply ends:
        each pass is a `PassRequest` for the driver to run, then the `Delta` it committed."""
        if not prompt:
            raise ValueError("the prompt is empty")
        started = time.perf_counter()
        cache = cache if cache is not None else self.backend.new_cache()
        if cache.tokens != list(prompt[: cache.length]) or cache.length >= len(prompt):
            raise ValueError("the cache does not hold a proper prefix of this prompt")
        stats = DecodeStats(prompt_tokens=len(prompt), cached_tokens=cache.length,
                            prefilled_tokens=len(prompt) - cache.length)
        offload = getattr(getattr(self.backend, "model", None), "expert_offload", None)
        offload_mark = offload.snapshot() if offload is not None else None
        yield from self._prefill(prompt, cache, cuts, on_prefill, stats, prefill_in_passes)

        drafter = self._reply_drafter(config, len(prompt))
        stats.draft_method = drafter.name if drafter is not None else "none"
        odds = self.controller.start(PREDICTION_PRIOR if config.prediction else None)
        reply = _Reply(history=list(prompt), detok=Detokenizer(self.tokenizer), drafter=drafter,
                       constraint=self.constraint(config.grammar), odds=odds)
        while reply.finish is None:
            drafts, draft_seconds = self._propose(reply, config)
            checkpoint = self.backend.checkpoint(cache) if drafts else None
            request = PassRequest([reply.history[-1], *drafts], cache)
            began = time.perf_counter()
            yield request
            new_tokens = self._commit_pass(reply, request, checkpoint, draft_seconds, began, config, stats, started)
            logprobs = reply.logprobs[len(reply.logprobs) - len(new_tokens):] if config.logprobs is not None else None
            yield Delta(new_tokens, reply.stream_text(config.stop), logprobs)

        stats.completion_tokens = len(reply.emitted)
        stats.total_seconds = time.perf_counter() - started
        stats.decode_seconds = stats.total_seconds - stats.ttft_seconds
        if offload is not None:
            stats.offload = offload.report(offload_mark)
        return Completion(reply.emitted, reply.detok.text, reply.finish, stats,
                          reply.logprobs if config.logprobs is not None else None)

    def _reply_drafter(self, config: GenerationConfig, start: int) -> Drafter | None:
        """The reply's own drafter: its prediction where the request sent one (whatever drafter the
        engine was built with), else a fork of the engine's; none when the reply is serial."""
        if not config.draft or self.controller.max_depth <= 0:
            return None
        if config.prediction:
            return PredictionDrafter(config.prediction, start)
        if self.drafter is None:
            return None
        fork = getattr(self.drafter, "fork", None)
        return fork() if fork is not None else self.drafter  # per-reply state

    def constraint(self, grammar: str | None) -> Constraint | None:
        """A reply's grammar: a lazy tool-call grammar (`engine.lazy_calls`) or one every row follows."""
        if not grammar:
            return None
        if is_lazy(grammar):
            try:
                return LazyCallConstraint(self.tokenizer, grammar, self.eos_token_ids)
            except ValueError as error:  # an aid, not a contract: the reply is then free (calls still parsed)
                log.warning("tool-call grammar dropped: %s", str(error).splitlines()[0][:300])
                return None
        return GrammarConstraint(self.tokenizer, grammar)

    def _prefill(self, prompt: Sequence[int], cache: CacheState, cuts: Sequence[int],
                 on_prefill: PrefillObserver | None, stats: DecodeStats,
                 in_passes: bool = False) -> Iterator[Delta | PassRequest]:
        """The plan's chunks up to the last prompt token (row 0 of the first pass), a layer per step,
        or (`in_passes`, chunks of at most PROMPT_PASS_MAX rows) as prefill requests the driver
        runs, each followed by an empty Delta. Both give the same bits where `in_passes` is allowed."""
        end = len(prompt) - 1
        for cut in [*self.plan(cache.length, end, cuts), end]:
            if cut <= cache.length:
                continue
            if in_passes and cut - cache.length <= PROMPT_PASS_MAX:
                while cache.length < cut:
                    request = PassRequest(list(prompt[cache.length : cut]), cache, prefill=True)
                    before = cache.length
                    yield request
                    if not request.tokens or cache.length != before + len(request.tokens):
                        raise RuntimeError("a prefill request must run a non-empty prefix of its rows")
                    stats.prefill_seconds += request.seconds * len(request.tokens) / max(1, request.rows)
                    yield Delta([], "")
                if on_prefill is not None:
                    on_prefill(cache)
                continue
            began = time.perf_counter()
            for _ in self.backend.prefill_steps(list(prompt[cache.length : cut]), cache):
                stats.prefill_seconds += time.perf_counter() - began  # this reply's own work, not its waits
                yield Delta([], "")  # one layer's share: other replies' passes may run before the next
                began = time.perf_counter()
            if on_prefill is not None:
                on_prefill(cache)
            stats.prefill_seconds += time.perf_counter() - began

    def _propose(self, reply: _Reply, config: GenerationConfig) -> tuple[list[int], float]:
        """The drafter's guesses for the next pass, as many as the depth controller finds worth it,
        and the seconds they took."""
        room = config.max_tokens - len(reply.emitted) - 1
        if reply.drafter is None or room <= 0:
            return [], 0.0
        depth = self.controller.depth(room, reply.odds)
        if not depth:
            return [], 0.0
        began = time.perf_counter()
        drafts = reply.drafter.propose(reply.history, depth, config.params)[:depth]
        return drafts, time.perf_counter() - began

    def _commit_pass(self, reply: _Reply, request: PassRequest, checkpoint: Checkpoint | None, draft_seconds: float,
                     began: float, config: GenerationConfig, stats: DecodeStats, started: float) -> list[int]:
        """After a verify pass ran: commit what serial decoding would have, roll the cache back to
        it, and return the committed tokens. `began`: when the reply asked for the pass."""
        drafts = request.tokens[1:]  # what the driver ran (it may have cut the drafts)
        base = request.cache.length - len(request.tokens)  # absolute position of row 0's token
        cache, logits = request.cache, request.logits
        committed = self._verify(logits, drafts, base, config.params, reply.constraint, stats)
        # the rows that chose the committed tokens, copied before a rollback's replay can reuse the buffer
        chosen_rows = logits[: len(committed)].copy() if config.logprobs is not None else None
        accepted = len(committed) - 1
        if checkpoint is not None:
            self.backend.rollback(cache, checkpoint, accepted + 1)
        seconds = time.perf_counter() - began
        stats.verify_passes += 1
        stats.pass_seconds.append(seconds)
        stats.drafted += len(drafts)
        stats.accepted += accepted
        self.controller.observe_pass(request.rows, request.seconds, reply.odds, len(request.tokens))  # whole pass
        if reply.drafter is not None:
            self.controller.observe_drafts(len(drafts), accepted, draft_seconds, reply.odds)
        now = time.perf_counter() - started
        kept = reply.commit(committed, now, config, self.eos_token_ids, stats)
        if kept < len(committed) and checkpoint is not None:  # the reply ended inside this pass
            self.backend.rollback(cache, checkpoint, kept)
        if len(reply.emitted) == kept:
            stats.ttft_seconds = now
            stats.first_pass_tokens = kept
        if chosen_rows is not None:  # row j chose committed[j]: its logprobs come from that row
            reply.logprobs.extend(token_logprob(chosen_rows[j], token, config.logprobs or 0)
                                  for j, token in enumerate(committed[:kept]))
        return committed[:kept]

    def _verify(self, logits, drafts: list[int], base: int, params: SamplingParams,
                constraint: Constraint | None, stats: DecodeStats) -> list[int]:
        """The target's own choice for each row, up to and including the first that is not its draft.

        Row j chooses the token at absolute position base + j + 1; row j + 1 is only read when
        draft j was the target's choice, so every committed token is the one serial decoding makes.
        """
        committed: list[int] = []
        for j in range(len(drafts) + 1):
            if constraint is None:
                token = choose(logits[j], base + j + 1, params)
            else:  # its state after the committed tokens before row j: as serial decoding has it
                token = constraint.choose(logits[j], base + j + 1, params)
                constraint.advance(token)
            committed.append(token)
            if j == len(drafts):
                break
            stats.record_position(j, drafts[j] == token)
            if drafts[j] != token:
                for later in range(j + 1, len(drafts)):  # proposed, never reached: counted as not accepted
                    stats.record_position(later, False)
                break
        return committed


@dataclass
class _Reply:
    """One reply's decoding state: the tokens so far, its text, its drafter fork and grammar."""

    history: list[int]
    detok: Detokenizer
    drafter: Drafter | None
    constraint: Constraint | None
    odds: DraftOdds  # its drafts' acceptance, from `DepthController.start` (replies differ)
    emitted: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per emitted token, when the config asks
    finish: str | None = None
    sent: int = 0  # characters of detok.text already streamed

    def commit(self, committed: list[int], now: float, config: GenerationConfig, eos: set[int],
               stats: DecodeStats) -> int:
        """Append the pass's tokens until the reply ends (EOS, a stop string, max_tokens); how many were kept."""
        for index, token in enumerate(committed):
            self.history.append(token)
            self.emitted.append(token)
            stats.emit_times.append(now)
            if token in eos:
                self.finish = "stop"
            else:
                self.detok.add(token)
                hit = find_stop(self.detok.text, config.stop)
                if hit is not None:
                    self.detok.text = self.detok.text[:hit]
                    self.finish = "stop"
            if self.finish is None and len(self.emitted) >= config.max_tokens:
                self.finish = "length"
            if self.finish is not None:
                return index + 1
        return len(committed)

    def stream_text(self, stops: Sequence[str]) -> str:
        """The text not yet streamed, holding back what could still become a stop string."""
        text = self.detok.text
        safe = len(text) if self.finish else len(text) - held_back(text, stops)
        piece, self.sent = text[self.sent:safe], max(self.sent, safe)
        return piece
