"""Drafters: cheap guesses at the next tokens, behind one small interface.

A drafter never decides what is emitted; the target's verify pass does. It only has to be fast
and often right. `propose(history, k, params)` gets every token of the conversation so far (the
last one is the pending token the next pass starts with) and returns up to k guesses for the
tokens after it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from agentfold.engine.sampler import SamplingParams, choose


class Drafter(Protocol):
    name: str

    def propose(self, history: Sequence[int], k: int, params: SamplingParams) -> list[int]: ...

    def reset(self) -> None: ...

    def fork(self) -> Drafter:
        """A drafter for one more reply: same settings, its own state (replies interleave)."""
        ...


class SuffixLookupDrafter:
    """Prompt / suffix lookup: continue the longest earlier match of the current suffix.

    Agents re-emit code they have read, so the tokens after the last occurrence of the current
    suffix are often exactly what comes next. An index of every `min_match`-gram maps to where it
    ended; candidates are extended backwards to the longest match, the most recent wins ties.
    The proposal length adapts: a short match proposes few tokens, a long one up to k.
    """

    name = "suffix"

    def __init__(self, min_match: int = 2, max_match: int = 64) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.reset()

    def fork(self) -> SuffixLookupDrafter:
        return SuffixLookupDrafter(self.min_match, self.max_match)

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.last_match = 0

    def _sync(self, history: Sequence[int]) -> None:
        known = len(self._tokens)
        if len(history) < known or list(history[:known]) != self._tokens:
            self.reset()  # the history was rewritten: index it again
        n = self.min_match
        for token in history[len(self._tokens) :]:
            self._tokens.append(int(token))
            if len(self._tokens) >= n:
                self._index[tuple(self._tokens[-n:])].append(len(self._tokens))

    def propose(self, history: Sequence[int], k: int, params: SamplingParams) -> list[int]:
        self._sync(history)
        tokens = self._tokens
        n = self.min_match
        if k <= 0 or len(tokens) <= n:
            return []
        ends = self._index.get(tuple(tokens[-n:]), [])
        best_end, best_len = -1, 0
        last = len(tokens)
        for end in reversed(ends[-256:]):
            if end >= last:
                continue
            length = n
            while length < self.max_match and end - length - 1 >= 0 and tokens[end - length - 1] == tokens[last - length - 1]:
                length += 1
            if length > best_len:
                best_end, best_len = end, length
            if length >= self.max_match:
                break
        self.last_match = best_len
        if best_end < 0:
            return []
        room = min(k, max(1, best_len - 1) if best_len < 8 else k)
        return list(tokens[best_end : best_end + room])


REJOIN_CANDIDATES = 256  # places in a prediction a rejoin compares the reply's tail with, at most


class PredictionDrafter:
    """Drafts from what the client expects the reply to be (OpenAI's Predicted Outputs).

    An editor that asks for a file with a few lines changed sends the file as it is: most of the
    reply is that text again. While the reply so far equals the prediction's start, the next
    tokens of the prediction are proposed; once the reply departs from it (an edited line), the
    reply's last `min_match` tokens are looked up in the prediction and what followed their
    longest match there is proposed, so drafting resumes where the reply rejoins the text.
    Proposals are only guesses: the verify pass decides, so the reply is the one serial decoding
    makes whatever the prediction holds. `start`: where the reply begins in the history.
    """

    name = "prediction"

    def __init__(self, prediction: Sequence[int], start: int, min_match: int = 2, max_match: int = 64) -> None:
        self.prediction = [int(token) for token in prediction]
        self.start = start
        self.min_match = min_match
        self.max_match = max_match
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> where it ends
        for end in range(min_match, len(self.prediction) + 1):
            self._ends[tuple(self.prediction[end - min_match : end])].append(end)
        self.reset()

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.prediction, self.start, self.min_match, self.max_match)

    def reset(self) -> None:
        self._prefix = 0  # reply tokens known to equal the prediction's first ones
        self._read = 0  # where in the prediction the last rejoin found the reply

    def propose(self, history: Sequence[int], k: int, params: SamplingParams) -> list[int]:
        reply = history[self.start :]
        if k <= 0 or len(history) < self.start:
            return []
        at = self._aligned(reply)
        if at is None:
            at = self._rejoin(reply)
        return self.prediction[at : at + k] if at is not None else []

    def _aligned(self, reply: Sequence[int]) -> int | None:
        """len(reply) while the reply is the prediction's start (checked once a token), else None."""
        prediction = self.prediction
        self._prefix = min(self._prefix, len(reply))
        while self._prefix < len(reply) and self._prefix < len(prediction) and (
                reply[self._prefix] == prediction[self._prefix]):
            self._prefix += 1
        return len(reply) if self._prefix == len(reply) else None

    def _rejoin(self, reply: Sequence[int]) -> int | None:
        """Where the prediction continues the longest match of the reply's tail, or None. A predicted
        file is read top to bottom: the candidates are taken from past where the last rejoin was
        (then from the top), at most REJOIN_CANDIDATES of them (a repetitive text has thousands),
        and of the longest matches the first so taken wins."""
        n = self.min_match
        if len(reply) < n:
            return None
        ends = self._ends.get(tuple(reply[-n:]), [])
        at = bisect.bisect_right(ends, self._read)
        best_end, best_len = None, 0
        for end in (ends[at:] + ends[:at])[:REJOIN_CANDIDATES]:
            length = n
            while (length < self.max_match and length < len(reply) and end - length - 1 >= 0
                   and self.prediction[end - length - 1] == reply[-length - 1]):
                length += 1
            if length > best_len:
                best_end, best_len = end, length
        if best_end is not None:
            self._read = best_end
        return best_end


class DraftModelDrafter:
    """A small model that shares the target's tokenizer drafts a chain, one token at a time.

    It draws with the target's sampler and noise (same seed, same absolute positions), so under
    sampling it picks the target's token whenever their distributions agree closely enough.
    Its cache follows the committed history: trimmed back to the common prefix, then caught up.
    """

    name = "draft-model"

    def __init__(self, backend) -> None:  # backend: MLXBackend of the draft model
        if backend.has_recurrent_state:
            raise ValueError("a draft model must have trimmable (attention-only) caches")
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        self.cache = self.backend.new_cache()

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.backend)  # shares the weights, not the cache

    def propose(self, history: Sequence[int], k: int, params: SamplingParams) -> list[int]:
        if k <= 0:
            return []
        cache = self.cache
        common = 0
        limit = min(cache.length, len(history))
        while common < limit and cache.tokens[common] == history[common]:
            common += 1
        if common == len(history):  # keep at least the pending token to feed
            common -= 1
        self.backend.truncate(cache, common)
        todo = list(history[common:])
        if len(todo) > 1:
            self.backend.prefill(todo[:-1], cache)
        logits = self.backend.forward(todo[-1:], cache)[-1]
        drafts: list[int] = []
        position = len(history)
        while True:
            token = choose(logits, position, params)
            drafts.append(token)
            if len(drafts) >= k:
                return drafts
            logits = self.backend.forward([token], cache)[-1]
            position += 1


class NoiseDrafter:
    """Proposes tokens that are mostly wrong, so every rollback path runs (tests, self-checks)."""

    name = "noise"

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def propose(self, history: Sequence[int], k: int, params: SamplingParams) -> list[int]:
        if k <= 0:
            return []
        count = int(self.rng.integers(1, k + 1))
        return [int(t) for t in self.rng.integers(0, self.vocab_size, size=count)]
