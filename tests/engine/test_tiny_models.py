"""Drafted == serial, token for token, on random tiny models of real mlx-lm architectures.

qwen3 (dense attention), qwen3_moe (routed experts) and qwen3_next (gated DeltaNet layers whose
`ArraysCache` cannot be trimmed, interleaved with attention) are built from mlx-lm's own classes
with random float32 weights; the tokenizer is a byte-level BPE trained in memory. Every drafter
kind runs against the serial reply of the same engine: suffix lookup, noise (wrong on purpose),
a reference oracle that corrupts one position per pass (so a pass is cut at every depth), and a
draft model. The decode loop is the real one; only its depth policy is pinned to the widest
row-exact pass, so that every test really verifies drafts instead of letting the cost model
decide that a serial step pays better on a model this small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# isort: split
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.engine.drafters import DraftModelDrafter, NoiseDrafter, SuffixLookupDrafter
from agentfold.engine.factory import build_engine
from agentfold.engine.mlx.backend import CacheState, MLXBackend
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.selfcheck import ExactnessReport, check_row_exactness
from agentfold.kernels import attention
from tests.helpers.drafting import PinnedDepth
from tests.helpers.tiny_models import build_model, loaded_model, make_tokenizer, perturbed_copy, tiny_config

ARCHS = ("qwen3", "qwen3_moe", "qwen3_next")
MAX_TOKENS = 40
LOGIT_SCALE = 4.0  # less flat random distributions: greedy loops, samples with some structure
PARAMS = {
    "greedy": SamplingParams(),
    "t0.7-s1": SamplingParams(temperature=0.7, seed=1),
    "t0.7-s2": SamplingParams(temperature=0.7, seed=2),
}
DRAFTERS = ("suffix", "noise", "oracle", "draft-model")
PROMPT_TEXT = "def add(a, b):\n    return a + b\n" * 3 + "def add(a, b):\n    return"  # ends on a repeat


@dataclass
class Target:
    arch: str
    config: dict
    loaded: LoadedModel
    backend: MLXBackend
    report: ExactnessReport
    draft: LoadedModel  # a draft model of the same vocabulary with trimmable caches
    draft_agrees: bool  # the draft is a perturbed copy of the target (it is right most of the time)


class FlawedOracleDrafter:
    """Proposes the serial reply's next tokens, with one position corrupted in most passes.

    The corrupted position cycles through 0..k-1 and "none", so passes are cut after every
    possible number of accepted drafts, and a full accept happens too.
    """

    name = "flawed-oracle"

    def __init__(self, prompt: list[int], reference: list[int], vocab_size: int, seed: int = 0,
                 corrupt: bool = True) -> None:
        self.prompt = list(prompt)
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.corrupt = corrupt
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def propose(self, history, k, params) -> list[int]:
        done = len(history) - len(self.prompt)
        assert list(history[: len(self.prompt)]) == self.prompt
        assert list(history[len(self.prompt) :]) == self.reference[:done], "the engine left the serial reply"
        drafts = self.reference[done : done + k]
        if self.corrupt and drafts:
            where = self.calls % (k + 1)
            if where < len(drafts):
                shift = 1 + int(self.rng.integers(self.vocab_size - 1))
                drafts[where] = (drafts[where] + shift) % self.vocab_size
        self.calls += 1
        return drafts


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def targets(tokenizer, model_dir) -> dict[str, Target]:
    vocab = len(tokenizer)
    built = {}
    for index, arch in enumerate(ARCHS):
        config = tiny_config(arch, vocab)
        model = build_model(config, seed=100 + index, logit_scale=LOGIT_SCALE)
        copy = perturbed_copy(model, config, seed=7, noise=0.05)  # before the backend makes it int8
        loaded = loaded_model(model, tokenizer, config, model_dir / arch)
        backend = MLXBackend(loaded)
        report = check_row_exactness(backend)
        if backend.has_recurrent_state:  # no trimmable copy possible: an unrelated tiny qwen3 drafts
            draft_config = tiny_config("qwen3", vocab, layers=1)
            draft_model = build_model(draft_config, seed=900, logit_scale=LOGIT_SCALE)
            agrees = False
        else:
            draft_config = config
            draft_model = copy
            agrees = True
        draft = loaded_model(draft_model, tokenizer, draft_config, model_dir / f"{arch}-draft")
        built[arch] = Target(arch, config, loaded, backend, report, draft, agrees)
    return built


@pytest.fixture(scope="session")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT_TEXT)


@pytest.fixture(scope="session")
def serial_replies():
    return {}


def make_engine(target: Target, drafter=None, eos: set[int] | None = None, pinned: bool = True) -> Engine:
    attention.install(target.backend.model)  # idempotent; in case another test restored mlx-lm's own
    engine = Engine(target.backend, target.loaded.tokenizer, eos or set(), drafter=drafter, exactness=target.report)
    if pinned:
        engine.controller = PinnedDepth(max_depth=engine.controller.max_depth)
    return engine


def serial(serial_replies, target: Target, prompt: list[int], params: SamplingParams,
           max_tokens: int = MAX_TOKENS) -> Completion:
    """The reply without drafting and without eos (cached per session)."""
    key = (target.arch, tuple(prompt), params, max_tokens)
    if key not in serial_replies:
        engine = make_engine(target)
        config = GenerationConfig(params=params, max_tokens=max_tokens, draft=False)
        completion = engine.generate(prompt, config)
        assert completion.stats.drafted == 0 and completion.stats.verify_passes == len(completion.tokens)
        serial_replies[key] = completion
    return serial_replies[key]


def make_drafter(kind: str, target: Target, prompt: list[int], reference: list[int]):
    vocab = len(target.loaded.tokenizer)
    if kind == "suffix":
        return SuffixLookupDrafter()
    if kind == "noise":
        return NoiseDrafter(vocab, seed=5)
    if kind == "oracle":
        return FlawedOracleDrafter(prompt, reference, vocab, seed=11)
    if kind == "draft-model":
        return DraftModelDrafter(MLXBackend(target.draft))
    raise ValueError(kind)


def cache_arrays(cache: CacheState) -> list[np.ndarray]:
    """Every array a cache holds that later passes read (KV up to its offset, recurrent state)."""
    arrays = []
    for layer in cache.layers:
        if isinstance(layer, ArraysCache):
            arrays.extend(np.array(a) for a in layer.cache if a is not None)
        else:
            arrays.append(np.array(layer.keys[..., : layer.offset, :]))
            arrays.append(np.array(layer.values[..., : layer.offset, :]))
    return arrays


def assert_same_cache(a: CacheState, b: CacheState) -> None:
    assert a.tokens == b.tokens
    left, right = cache_arrays(a), cache_arrays(b)
    assert len(left) == len(right)
    for x, y in zip(left, right, strict=True):
        assert x.shape == y.shape and np.array_equal(x, y)


# --- 1. the self-check lets these architectures draft ------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_selfcheck_allows_drafting(targets, arch):
    target = targets[arch]
    report = target.report
    assert report.max_width > 1, report.describe()
    assert report.checked[2]
    assert all(report.checked[w] for w in range(2, report.max_width + 1))
    assert target.backend.has_recurrent_state == (arch == "qwen3_next")


def test_selfcheck_rollback_is_repeatable(targets):
    """A checkpoint of recurrent state survives the passes after it and can be restored twice."""
    backend = targets["qwen3_next"].backend
    cache = backend.new_cache()
    backend.prefill(list(range(20, 40)), cache)
    checkpoint = backend.checkpoint(cache)
    before = cache_arrays(cache)
    first = backend.forward([41, 42, 43], cache)
    backend.rollback(cache, checkpoint, 0)
    assert [np.array_equal(x, y) for x, y in zip(before, cache_arrays(cache), strict=True)] == [True] * len(before)
    backend.forward([50, 51], cache)
    backend.rollback(cache, checkpoint, 0)
    again = backend.forward([41, 42, 43], cache)
    assert np.array_equal(first, again)


# --- 2. drafted == serial for every drafter ----------------------------------------------------


@pytest.mark.parametrize("drafter_kind", DRAFTERS)
@pytest.mark.parametrize("params_id", list(PARAMS))
@pytest.mark.parametrize("arch", ARCHS)
def test_drafted_equals_serial(targets, prompt, serial_replies, arch, params_id, drafter_kind):
    target = targets[arch]
    params = PARAMS[params_id]
    reference = serial(serial_replies, target, prompt, params)
    assert reference.finish_reason == "length" and len(reference.tokens) == MAX_TOKENS

    drafter = make_drafter(drafter_kind, target, prompt, reference.tokens)
    engine = make_engine(target, drafter)
    assert engine.max_drafts == target.report.max_width - 1 >= 1
    if drafter_kind == "oracle":  # few enough positions that the oracle's cut cycles through each one
        engine.controller = PinnedDepth(max_depth=min(3, engine.max_drafts))
    cache = target.backend.new_cache()
    drafted = engine.generate(prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS), cache=cache)

    assert drafted.tokens == reference.tokens
    assert drafted.text == reference.text
    assert drafted.finish_reason == "length"
    assert drafted.token_sha == reference.token_sha
    assert cache.tokens == prompt + drafted.tokens[:-1]  # the last token is pending, never in the cache

    stats = drafted.stats
    assert stats.draft_method == drafter.name
    assert stats.drafted > 0, "no drafts were verified"
    assert stats.completion_tokens == MAX_TOKENS
    assert stats.verify_passes + stats.accepted == MAX_TOKENS  # each pass commits accepted + 1
    if drafter_kind in ("noise", "oracle") or (drafter_kind == "draft-model" and not target.draft_agrees):
        assert stats.discarded > 0, "no pass was rolled back"
    if drafter_kind == "oracle" or (drafter_kind == "draft-model" and target.draft_agrees):
        assert stats.accepted > 0 and stats.discarded > 0
    if drafter_kind == "oracle":
        # every draft position was both accepted and rejected in some pass: cut at every depth
        depth = engine.max_drafts
        assert len(stats.proposed_per_position) == depth
        for position in range(depth):
            assert 0 < stats.accepted_per_position[position] < stats.proposed_per_position[position]
        assert stats.verify_passes < MAX_TOKENS


@pytest.mark.parametrize("drafter_kind", ("suffix", "draft-model"))
@pytest.mark.parametrize("arch", ARCHS)
def test_factory_engine_equals_serial(targets, prompt, arch, drafter_kind):
    """The engine `build_engine` makes (its own self-check, adaptive depth, eos) is exact too."""
    target = targets[arch]
    draft = target.draft if drafter_kind == "draft-model" else None
    engine = build_engine(target.loaded, drafter=drafter_kind, draft_model=draft)
    assert engine.exactness.max_width == target.report.max_width
    for params in (PARAMS["greedy"], PARAMS["t0.7-s1"]):
        config = GenerationConfig(params=params, max_tokens=MAX_TOKENS)
        drafted = engine.generate(prompt, config)
        plain = engine.generate(prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=False))
        assert drafted.tokens == plain.tokens
        assert drafted.finish_reason == plain.finish_reason


# --- 3. stopping, and the cache a drafted reply leaves behind ----------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_max_tokens_finishes_with_length(targets, prompt, serial_replies, arch):
    target = targets[arch]
    params = PARAMS["t0.7-s2"]
    full = serial(serial_replies, target, prompt, params)
    for max_tokens in (1, 2, 3, 4, 7):
        reference = serial(serial_replies, target, prompt, params, max_tokens=max_tokens)
        assert reference.finish_reason == "length"
        assert reference.tokens == full.tokens[:max_tokens]
        drafter = FlawedOracleDrafter(prompt, full.tokens, len(target.loaded.tokenizer), corrupt=False)
        drafted = make_engine(target, drafter).generate(prompt, GenerationConfig(params=params, max_tokens=max_tokens))
        assert drafted.finish_reason == "length"
        assert drafted.tokens == reference.tokens
        assert drafted.stats.completion_tokens == max_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_a_pass(targets, prompt, serial_replies, arch):
    """An eos among accepted drafts ends the reply there, and the cache is cut back exactly."""
    target = targets[arch]
    params = PARAMS["greedy"]
    full = serial(serial_replies, target, prompt, params).tokens
    firsts = [i for i in range(3, len(full) - 1) if full[i] not in full[:i]][:4]
    assert len(firsts) >= 3, "the tiny model's reply repeats too much to place an eos"
    inside = 0
    for index in firsts:
        eos = {full[index]}
        serial_cache = target.backend.new_cache()
        reference = make_engine(target, eos=eos).generate(
            prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=False), cache=serial_cache
        )
        assert reference.finish_reason == "stop" and reference.tokens == full[: index + 1]

        drafter = FlawedOracleDrafter(prompt, full, len(target.loaded.tokenizer), corrupt=False)
        cache = target.backend.new_cache()
        drafted = make_engine(target, drafter, eos=eos).generate(
            prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS), cache=cache
        )
        assert drafted.finish_reason == "stop"
        assert drafted.tokens == reference.tokens
        stats = drafted.stats
        inside += stats.verify_passes + stats.accepted > len(drafted.tokens)  # committed past the eos

        # the cache holds what serial decoding leaves (so the next reply from it is the same)
        assert cache.tokens == prompt + drafted.tokens[:-1]
        assert_same_cache(cache, serial_cache)
    assert inside > 0, "no eos landed inside a verify pass"


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_drafting_continues_identically(targets, tokenizer, prompt, serial_replies, arch):
    """Drafted turn 1 in a cache, then turn 2 from it == turn 2 from a serial or a fresh cache."""
    target = targets[arch]
    backend = target.backend
    params = PARAMS["t0.7-s1"]
    reference = serial(serial_replies, target, prompt, params)

    drafted_cache = backend.new_cache()
    oracle = FlawedOracleDrafter(prompt, reference.tokens, len(tokenizer), seed=3)
    first = make_engine(target, oracle).generate(prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS),
                                                 cache=drafted_cache)
    assert first.tokens == reference.tokens
    assert first.stats.discarded > 0 and first.stats.accepted > 0

    # the drafted cache is bit for bit the cache serial decoding leaves
    serial_cache = backend.new_cache()
    make_engine(target).generate(prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=False),
                                 cache=serial_cache)
    assert_same_cache(drafted_cache, serial_cache)

    follow = prompt + first.tokens + tokenizer.encode("\nfor i in range(3):\n    print(i)\n")
    second_params = SamplingParams(temperature=0.7, seed=3)
    config = GenerationConfig(params=second_params, max_tokens=MAX_TOKENS)

    resumed = make_engine(target, SuffixLookupDrafter()).generate(follow, config, cache=drafted_cache)
    from_serial = make_engine(target).generate(follow, GenerationConfig(params=second_params, max_tokens=MAX_TOKENS,
                                                                        draft=False), cache=serial_cache)
    assert resumed.tokens == from_serial.tokens
    assert resumed.stats.cached_tokens == len(prompt) + MAX_TOKENS - 1

    # a fresh cache, prefilled in the chunks the resumed one was built in: the prompt's chunk,
    # one token per decode step of turn 1, then the rest of turn 2's prompt
    start = len(prompt) - 1
    cuts = list(range(start, start + MAX_TOKENS + 1))
    fresh = make_engine(target, NoiseDrafter(len(tokenizer), seed=1)).generate(follow, config, cuts=cuts)
    assert fresh.tokens == resumed.tokens
    assert fresh.stats.cached_tokens == 0


def test_recurrent_state_is_not_truncatable(targets):
    backend = targets["qwen3_next"].backend
    cache = backend.new_cache()
    backend.prefill([30, 31, 32, 33], cache)
    with pytest.raises(ValueError):
        backend.truncate(cache, 2)
    with pytest.raises(ValueError):
        DraftModelDrafter(backend)


def test_tiny_models_are_deterministic(tokenizer):
    """Same seed, same weights: the references above do not depend on test order."""
    config = tiny_config("qwen3_next", len(tokenizer))
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    tokens = mx.array([[5, 6, 7, 8]], dtype=mx.int32)
    assert np.array_equal(np.array(a(tokens)), np.array(b(tokens)))
