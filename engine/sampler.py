"""The exact sampler of DESIGN contract 1.

The token at absolute position p is argmax_i(logit_i / T + g(seed, p, i)) over the candidates that
survive top-k, top-p and min-p, with g Gumbel noise hashed from (seed, p, i). T = 0 is greedy:
argmax_i logit_i, ties to the lowest id. A choice depends only on the row's logits, the seed and
p, never on how many rows a pass had or which drafter proposed the token: that is what makes a
drafted reply byte-identical to a serial one. Drafters call the same function on their own
logits, so they draw with the same noise and agree with the target more often.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BELOW_ONE = np.nextafter(1.0, 0.0)  # 1 - 2**-53, the largest float64 below 1
MIN_TEMPERATURE = 1e-30  # below this (but above 0) logits / T can overflow float64 (e.g. 5e-324)


@dataclass(frozen=True)
class SamplingParams:
    """How one reply is drawn. `seed` only matters when temperature > 0."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf (and NaN probabilities)
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, not {self.temperature:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: np.ndarray, shifted: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finalizer of uint64 x (arithmetic modulo 2**64: numpy's uint64 wraps); with
    `shifted` (a scratch array like x) in place, into x."""
    with np.errstate(over="ignore"):
        if shifted is None:
            x, shifted = x + _GOLDEN, np.empty_like(x)
        else:
            x += _GOLDEN
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 0)):
            np.right_shift(x, np.uint64(shift), out=shifted)
            x ^= shifted
            if factor:
                x *= np.uint64(factor)
        return x


def _noise(seed: int, position: int, ids: np.ndarray, bits: np.ndarray, shifted: np.ndarray, out: np.ndarray,
           gumbel: bool) -> np.ndarray:
    """u (see `uniform`), or with `gumbel` g = -log(-log(u)), of uint64 `ids` into float64 `out`;
    `bits` and `shifted` are uint64 scratch arrays like `ids`."""
    # operator.index: numpy integers (np.int64 positions) work like Python ints; `np.int64 & 2**64-1`
    # would raise OverflowError.
    seed, position = operator.index(seed), operator.index(position)
    key = _splitmix64(np.array([np.uint64(seed & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(position & 0xFFFFFFFFFFFFFFFF))
    np.bitwise_xor(ids, key, out=bits)
    bits = _splitmix64(bits, shifted)  # (in place: the same array)
    bits >>= np.uint64(11)
    np.add(bits, 0.5, out=out)  # float64(bits) + 0.5, exactly (bits < 2**53)
    out *= 1.0 / 9007199254740992.0
    # (2**53 - 1) + 0.5 rounds to 2**53 in float64, so the top 53-bit value gave u == 1.0 and g == +inf;
    # clamp it to the largest float64 below 1 (every other value is unchanged).
    np.minimum(out, _BELOW_ONE, out=out)
    if gumbel:
        np.log(out, out=out)
        np.negative(out, out=out)
        np.log(out, out=out)
        np.negative(out, out=out)
    return out


def uniform(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """u in (0, 1) hashed from (seed, position, token id); float64."""
    ids = token_ids.astype(np.uint64)
    return _noise(seed, position, ids, np.empty_like(ids), np.empty_like(ids), np.empty(ids.shape), gumbel=False)


def gumbel(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """g = -log(-log(u)): the noise that turns an argmax into an exact softmax draw."""
    ids = token_ids.astype(np.uint64)
    return _noise(seed, position, ids, np.empty_like(ids), np.empty_like(ids), np.empty(ids.shape), gumbel=True)


def candidates(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Token ids that survive top-k, then top-p, then min-p (on softmax(logits / T)), ascending."""
    ids = _all_ids(logits.shape[0])
    if not (params.top_k and params.top_k < logits.shape[0]) and params.top_p >= 1.0 and params.min_p <= 0.0:
        return ids  # no filter: every token
    logits = logits.astype(np.float64)
    if params.top_k and params.top_k < logits.shape[0]:
        order = np.lexsort((ids, -logits))  # by logit descending, ties to the lowest id
        ids = np.sort(order[: params.top_k])
    if params.top_p < 1.0 or params.min_p > 0.0:
        scaled = logits[ids] / params.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        keep = np.ones(ids.shape[0], dtype=bool)
        if params.top_p < 1.0:
            order = np.lexsort((ids, -probs))
            before = np.cumsum(probs[order]) - probs[order]  # mass strictly before each token
            keep_sorted = before < params.top_p
            keep = np.zeros_like(keep)
            keep[order[keep_sorted]] = True
        if params.min_p > 0.0:
            keep &= probs >= params.min_p * probs.max()
        ids = ids[keep]
    return ids


def _all_ids(vocab: int) -> np.ndarray:
    """0..vocab-1 (a shared read-only array: callers never write to it)."""
    ids = _ALL_IDS.get(vocab)
    if ids is None:
        ids = _ALL_IDS[vocab] = np.arange(vocab)
        ids.flags.writeable = False
    return ids


_ALL_IDS: dict[int, np.ndarray] = {}


def choose(logits: np.ndarray, position: int, params: SamplingParams) -> int:
    """The token for absolute `position` from one row of logits (float32, shape [vocab])."""
    if params.greedy:
        return int(np.argmax(logits))  # first maximum: ties go to the lowest id
    ids = candidates(logits, params)
    if ids.shape[0] < logits.shape[0]:
        scores = logits[ids].astype(np.float64) / params.temperature + gumbel(params.seed, position, ids)
        return int(ids[int(np.argmax(scores))])
    ids, bits, shifted, noise, scores = _ROWS.get(logits.shape[0])
    _noise(params.seed, position, ids, bits, shifted, noise, gumbel=True)
    np.copyto(scores, logits)  # float32 -> float64, exactly: the scores `gumbel`'s path adds to
    scores /= params.temperature
    scores += noise
    return int(np.argmax(scores))


class _Rows(threading.local):
    """Per thread, the buffers of an unfiltered row's draw, reused: fresh arrays of a vocabulary's
    size are mapped and faulted in on every call (most of a sampled row's time in a server)."""

    size = 0

    def get(self, vocab: int) -> tuple[np.ndarray, ...]:
        if self.size != vocab:
            self.size = vocab
            self.ids = np.arange(vocab, dtype=np.uint64)
            self.bits, self.shifted = np.empty(vocab, np.uint64), np.empty(vocab, np.uint64)
            self.noise, self.scores = np.empty(vocab), np.empty(vocab)
        return self.ids, self.bits, self.shifted, self.noise, self.scores


_ROWS = _Rows()


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability and the most likely tokens of its row (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """log_softmax of the row that chose `token`, at `token`, and the row's `top` most likely tokens.

    This is the model's own distribution, as OpenAI reports it: the logits the sampler read, with
    no temperature, no top-k / top-p / min-p truncation and no grammar mask applied (the chosen
    token of a temperature or grammar draw may therefore not be the top one). The arithmetic is
    float64 and depends only on the row, computed the same way for every row, so a row that is
    bit-identical in a drafted pass and in a serial step gives bit-identical logprobs. Ties in
    `top` go to the lowest id, like greedy choice.
    """
    row = np.array(logits, dtype=np.float64)  # a fresh contiguous copy: same layout for every row
    shifted = row - row.max()
    log_total = float(np.log(np.exp(shifted).sum()))
    logprobs = shifted - log_total
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, row.shape[0])
        head = np.argpartition(-logprobs, count - 1)[:count] if count < row.shape[0] else np.arange(row.shape[0])
        cut = logprobs[head].min()
        head = np.flatnonzero(logprobs >= cut)  # every token tied with the last one: ties by lowest id
        order = np.lexsort((head, -logprobs[head]))[:count]
        best = tuple((int(head[i]), float(logprobs[head[i]])) for i in order)
    return TokenLogprob(int(token), float(logprobs[int(token)]), best)
