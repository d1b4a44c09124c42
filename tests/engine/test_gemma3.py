"""Gemma 3 270M (Q4_K_M GGUF, dequantized with the gguf package): loads, answers, drafts exactly."""

from __future__ import annotations

import pytest

from agentfold.engine.decode import GenerationConfig
from agentfold.engine.factory import build_engine
from agentfold.engine.sampler import SamplingParams


@pytest.fixture(scope="module")
def gemma3_engine(gemma3_folder):
    return build_engine(gemma3_folder, max_width=8)


@pytest.mark.slow  # the second real model: loading it is most of the time
def test_gemma3_continues_sensibly(gemma3_engine):
    """Wrong weight mapping (norms, names, dequantization) gives noise; the real model counts on."""
    ids = gemma3_engine.tokenizer.encode("1, 2, 3, 4, 5, 6,")
    assert ids[0] == gemma3_engine.tokenizer.bos_token_id
    completion = gemma3_engine.generate(ids, GenerationConfig(max_tokens=6, draft=False))
    assert completion.text.startswith(" 7, 8"), completion.text
    france = gemma3_engine.generate(gemma3_engine.tokenizer.encode("The capital of France is"),
                                    GenerationConfig(max_tokens=8, draft=False))
    assert "France" in france.text or "Paris" in france.text, france.text


@pytest.mark.slow
def test_gemma3_drafted_equals_serial(gemma3_engine):
    assert gemma3_engine.exactness.drafting, gemma3_engine.exactness.describe()
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n" * 2
    ids = gemma3_engine.tokenizer.encode(text + "def fib(n):")
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=4)):
        serial = gemma3_engine.generate(ids, GenerationConfig(params=params, max_tokens=24, draft=False))
        drafted = gemma3_engine.generate(ids, GenerationConfig(params=params, max_tokens=24))
        assert drafted.tokens == serial.tokens
