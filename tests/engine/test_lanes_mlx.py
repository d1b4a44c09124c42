"""Lanes on MLX: several sequences' passes as one pass give each lane the bits of its solo `forward`.

Three lanes with different cache lengths and different row counts (a decode step and two verify
passes) run through `forward_many`; each lane's logits must equal, bit for bit, what `forward`
gives from the same cache state, and the caches must end in the same state (the next one-row
step agrees too). The lanes path must really run where it is supported (a spy counts it), and
models it does not restate (Gemma 3, a hybrid recurrent model) must fall back with equal results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentfold.engine.mlx import lanes
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.protocol import CacheState, forward_lanes
from tests.helpers.tiny_models import build_model, loaded_model, make_tokenizer, tiny_config

PREFIXES = (7, 23, 40)  # cache lengths before the pass
ROWS = (1, 3, 5)  # rows of each lane's pass


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def tiny_backend(tokenizer, model_type: str, tmp_path: Path) -> MLXBackend:
    """A random tiny model of `model_type` (llama and qwen2 reuse the qwen3 sizes)."""
    vocab = len(tokenizer)
    if model_type in ("qwen3", "qwen3_next"):
        config = tiny_config(model_type, vocab)
    elif model_type in ("llama", "qwen2"):
        config = {**tiny_config("qwen3", vocab), "model_type": model_type}
        if model_type == "qwen2":
            del config["head_dim"]  # qwen2 derives it: 64 / 4 = 16 all the same
    elif model_type == "gemma3_text":
        config = {**tiny_config("qwen3", vocab), "model_type": "gemma3_text", "query_pre_attn_scalar": 16,
                  "sliding_window": 16, "sliding_window_pattern": 2}
    else:
        raise ValueError(model_type)
    model = build_model(config, seed=11)
    return MLXBackend(loaded_model(model, tokenizer, config, tmp_path / model_type))


def spy_on_lanes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the lanes passes `forward_many` makes (the backend calls `lanes.forward_lanes`)."""
    calls: list[int] = []
    original: Callable[..., Any] = lanes.forward_lanes

    def counted(model: Any, lane_list: Sequence[Any]) -> Any:
        calls.append(len(lane_list))
        return original(model, lane_list)

    monkeypatch.setattr(lanes, "forward_lanes", counted)
    return calls


def assert_lanes_equal_solo(backend: Any, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, n).tolist() for n in PREFIXES]
    passes = [rng.integers(0, vocab, n).tolist() for n in ROWS]

    def prefilled() -> list[CacheState]:
        caches = []
        for prompt in prompts:
            cache = backend.new_cache()
            backend.prefill(prompt, cache)
            caches.append(cache)
        return caches

    solo_caches, lane_caches = prefilled(), prefilled()
    solo = [backend.forward(tokens, cache) for tokens, cache in zip(passes, solo_caches, strict=True)]
    together = backend.forward_many(list(zip(passes, lane_caches, strict=True)))
    assert len(together) == len(solo)
    for alone, joint, rows in zip(solo, together, ROWS, strict=True):
        assert joint.dtype == np.float32 and joint.shape == (rows, alone.shape[1])
        assert np.array_equal(alone, joint)
    for alone, joint in zip(solo_caches, lane_caches, strict=True):
        assert joint.tokens == alone.tokens
        step = int(rng.integers(0, vocab))
        assert np.array_equal(backend.forward([step], alone), backend.forward([step], joint))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_lanes_equal_solo_tiny(tokenizer, model_type, tmp_path, monkeypatch):
    backend = tiny_backend(tokenizer, model_type, tmp_path)
    assert lanes.supports(backend.model)
    calls = spy_on_lanes(monkeypatch)
    assert_lanes_equal_solo(backend, len(tokenizer))
    assert calls == [len(ROWS)]


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_unsupported_models_fall_back(tokenizer, model_type, tmp_path, monkeypatch):
    backend = tiny_backend(tokenizer, model_type, tmp_path)
    assert not lanes.supports(backend.model)
    calls = spy_on_lanes(monkeypatch)
    assert_lanes_equal_solo(backend, len(tokenizer))
    assert calls == []


def test_shared_cache_falls_back(tokenizer, tmp_path, monkeypatch):
    """One cache in two lanes is not a lanes pass: solo passes, in order, as `forward` would run them."""
    backend = tiny_backend(tokenizer, "llama", tmp_path)
    calls = spy_on_lanes(monkeypatch)
    shared, reference = backend.new_cache(), backend.new_cache()
    together = backend.forward_many([([5, 6], shared), ([7], shared)])
    alone = [backend.forward([5, 6], reference), backend.forward([7], reference)]
    assert all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
    assert shared.tokens == reference.tokens == [5, 6, 7] and calls == []


def test_lanes_equal_solo_smollm2(smollm2_mlx_engine, monkeypatch):
    backend = smollm2_mlx_engine.backend
    assert lanes.supports(backend.model)
    calls = spy_on_lanes(monkeypatch)
    assert_lanes_equal_solo(backend, backend.vocab_size, seed=1)
    assert calls == [len(ROWS)]
    assert forward_lanes(backend, []) == []
