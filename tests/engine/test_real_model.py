"""Drafted == serial, byte for byte, on the real SmolLM2-135M-Instruct; loading paths agree."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.drafters import DraftModelDrafter
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.mlx.loader import LoadedModel, load_model
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.selfcheck import check_row_exactness
from tests.conftest import chat_ids

SNIPPET = textwrap.dedent(inspect.getsource(json.dumps))[:900]
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"

PROMPTS = [
    f"Repeat this code exactly:\n```python\n{SNIPPET}\n```",
    f"Rename the function add to plus and print the whole file:\n```python\n{CODE}```",
    f"Add a docstring to each function and print the file:\n```python\n{CODE}```",
    "Write a Python function that checks whether a number is prime.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain recursion to a child in two sentences.",
    "List three colors.",
    "Write a SQL query that counts rows in a table called users.",
    "Translate 'good morning' to French.",
    "Write a bash command that lists files sorted by size.",
    "Give me a JSON object with keys name and age.",
    "What is 12 times 12?",
    "Write a short story opening about a robot.",
    "Summarize what a linked list is.",
    f"Copy this text back to me: {CODE * 2}",
    "Write a Python class for a stack with push and pop.",
    "Name two planets in the solar system.",
    "Write a regular expression that matches an email address.",
    "Say hello in three languages.",
    "Describe the smell of rain.",
    "Fix the bug: ```python\ndef mean(xs):\n    return sum(xs) / len(xs) + 1\n```",
]

GREEDY = SamplingParams()
SAMPLED = [SamplingParams(temperature=0.7, seed=seed) for seed in (1, 7)]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def prompts(smollm2_mlx_engine) -> list[list[int]]:
    return [chat_ids(smollm2_mlx_engine.tokenizer, text) for text in PROMPTS]


@pytest.fixture(scope="module")
def serial(smollm2_mlx_engine, prompts):
    """Serial reference replies, computed once: {(prompt index, params): tokens}."""
    out = {}
    for index, ids in enumerate(prompts):
        settings = [GREEDY, *SAMPLED] if index % 4 == 0 else [GREEDY]  # sampled: every kind of prompt, fewer
        for params in settings:
            config = GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=False)
            completion = smollm2_mlx_engine.generate(ids, config)
            assert completion.stats.drafted == 0
            out[index, params] = completion.tokens
    return out


def test_self_check_allows_drafting(smollm2_mlx_engine):
    report = smollm2_mlx_engine.exactness
    assert report.drafting, report.describe()
    assert all(report.checked[w] for w in range(2, report.max_width + 1))


@pytest.mark.slow
def test_suffix_drafted_equals_serial(smollm2_mlx_engine, prompts, serial):
    drafted_total = accepted_total = 0
    for (index, params), reference in serial.items():
        config = GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=True)
        completion = smollm2_mlx_engine.generate(prompts[index], config)
        assert completion.tokens == reference, (PROMPTS[index][:40], params)
        drafted_total += completion.stats.drafted
        accepted_total += completion.stats.accepted
    assert len(serial) >= 22 + 2 * 6
    assert drafted_total > 0 and accepted_total > 0  # the drafted path really ran


def _draft_engine(target: Engine, draft: LoadedModel) -> Engine:
    return Engine(target.backend, target.tokenizer, target.eos_token_ids,
                  drafter=DraftModelDrafter(MLXBackend(draft)), exactness=target.exactness)


@pytest.mark.slow
def test_target_as_its_own_draft_model(smollm2_mlx_engine, smollm2_gguf, prompts, serial):
    engine = _draft_engine(smollm2_mlx_engine, load_model(smollm2_gguf))
    cases = [key for key in serial if key[0] in (0, 1, 3, 4)]
    accepted = 0
    for index, params in cases:
        completion = engine.generate(prompts[index], GenerationConfig(params=params, max_tokens=MAX_TOKENS))
        assert completion.tokens == serial[index, params]
        accepted += completion.stats.accepted
    assert accepted > 0


@pytest.mark.slow
def test_random_weight_draft_model(smollm2_mlx_engine, prompts, serial):
    """A draft model of the same vocabulary with random weights: mostly rejected, still exact."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": smollm2_mlx_engine.backend.vocab_size, "tie_word_embeddings": True}
    model_class, args_class = _get_classes(config)
    mx.random.seed(5)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    draft = LoadedModel(model, smollm2_mlx_engine.tokenizer, config, smollm2_mlx_engine.backend.loaded.path, "float32")
    engine = _draft_engine(smollm2_mlx_engine, draft)
    engine.controller.prior = 0.95  # every reply starts there: keep proposing so that every rollback path runs
    discarded = 0
    for index, params in [key for key in serial if key[0] in (2, 5)]:
        completion = engine.generate(prompts[index], GenerationConfig(params=params, max_tokens=MAX_TOKENS))
        assert completion.tokens == serial[index, params]
        discarded += completion.stats.discarded
    assert discarded > 0


def test_stop_strings_and_length(smollm2_mlx_engine, prompts):
    config = GenerationConfig(max_tokens=30, draft=False)
    full = smollm2_mlx_engine.generate(prompts[3], config)
    assert full.finish_reason == "length" and len(full.tokens) == 30
    stop = full.text[10:14]
    stopped = smollm2_mlx_engine.generate(prompts[3], GenerationConfig(max_tokens=30, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.tokens == full.tokens[: len(stopped.tokens)]


def test_streamed_text_equals_final_text(smollm2_mlx_engine, prompts):
    generation = smollm2_mlx_engine.stream(prompts[0], GenerationConfig(max_tokens=MAX_TOKENS))
    pieces = [delta.text for delta in generation]
    assert "".join(pieces) == generation.completion.text
    assert generation.completion.text == smollm2_mlx_engine.tokenizer.decode(
        generation.completion.tokens, skip_special_tokens=True)


def test_gguf_and_converted_folder_agree(smollm2_mlx_engine, smollm2_folder, prompts):
    folder_engine = Engine(MLXBackend(load_model(smollm2_folder)), smollm2_mlx_engine.tokenizer,
                           smollm2_mlx_engine.eos_token_ids)
    config = GenerationConfig(max_tokens=12, draft=False)
    for ids in prompts[:3]:
        assert folder_engine.generate(ids, config).tokens == smollm2_mlx_engine.generate(ids, config).tokens


def test_inexact_attention_is_caught(smollm2_gguf):
    """Without row-exact attention, MLX's batched path differs: the self-check caps or disables drafting."""
    from agentfold.kernels import attention

    loaded = load_model(smollm2_gguf)
    attention.uninstall()
    try:
        report = check_row_exactness(MLXBackend(loaded, row_exact_attention=False), max_width=6)
    finally:
        attention.install(loaded.model)
    assert not all(report.checked.values())
    assert report.max_width < 6
