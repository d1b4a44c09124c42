"""Gemma 3 on the torch backend: the same model as transformers and mlx-lm, exact drafting and
prefill across the sliding window, and the real Gemma 3 270M agreeing with the MLX backend.

Tiny random Gemma 3 folders (tests/helpers/torch_tiny.py: window 8, every third layer global, a
query scale that is not head_dim's) make the window matter within a few dozen tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.factory import build_engine
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.mlx.loader import load_model
from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model
from agentfold.engine.torch.models.gemma3 import Layout
from agentfold.kernels import torch_cpu
from tests.engine.test_torch_backend import GREEDY, SAMPLED, TINY_PROMPT, assert_drafted_equals_serial
from tests.helpers.torch_tiny import write_gemma3_folder

WINDOW = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3-tiny")
    return {"mixed": write_gemma3_folder(root / "mixed", seed=5, window=WINDOW),
            "sliding": write_gemma3_folder(root / "sliding", seed=6, layers=2, window=WINDOW, all_sliding=True)}


@pytest.fixture(scope="module")
def tiny(folders) -> TorchBackend:
    return TorchBackend(load_torch_model(folders["mixed"], device="cpu"))


def _transformers_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_tiny_matches_transformers_and_mlx_lm(folders):
    """Float weights: transformers' Gemma3ForCausalLM and mlx-lm's gemma3_text are independent
    references (norms, scales, window, both RoPE bases); 100 tokens cross the window many times."""
    tokens = list(range(40, 140))
    ours = TorchBackend(load_torch_model(folders["mixed"], device="cpu"), quant="none")
    reference = _transformers_logits(folders["mixed"], tokens)
    mlx = MLXBackend(load_model(folders["mixed"]), quant="none")
    tolerance = 1e-5 * float(np.abs(reference).max())
    wide = ours.forward(tokens, ours.new_cache())  # over 64 rows: the batched (prefill) attention blocks
    assert float(np.abs(wide - reference).max()) < tolerance
    rows = ours.forward(tokens[:60], ours.new_cache())  # each row attends alone (decode / verify)
    assert float(np.abs(rows - reference[:60]).max()) < tolerance
    assert float(np.abs(mlx.forward(tokens, mlx.new_cache()) - reference).max()) < tolerance


def test_linear_rope_scaling_matches_transformers(folders, tmp_path):
    """The larger Gemma 3s scale the global layers' RoPE linearly; a config in transformers' own
    current format (rope_parameters, layer_types) gives its logits."""
    import json
    import shutil

    from transformers import Gemma3TextConfig

    folder = Path(shutil.copytree(folders["mixed"], tmp_path / "scaled"))
    config = json.loads((folder / "config.json").read_text())
    written = Gemma3TextConfig(**{**config, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}).to_dict()
    assert "rope_parameters" in written and "rope_theta" not in written
    (folder / "config.json").write_text(json.dumps(written))
    layout = Layout.from_config(written)
    assert (layout.local_theta, layout.global_theta, layout.global_factor) == (1e4, 1e6, 8.0)
    assert layout.sliding == [True, True, False] and layout.window == WINDOW
    tokens = list(range(40, 100))
    ours = TorchBackend(load_torch_model(folder, device="cpu"), quant="none")
    reference = _transformers_logits(folder, tokens)
    assert float(np.abs(ours.forward(tokens, ours.new_cache()) - reference).max()) < 1e-5 * np.abs(reference).max()
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        Layout.from_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})


@pytest.mark.parametrize("prefilled", [False, True], ids=["one-pass", "prefill-then-step"])
def test_sliding_layers_see_only_their_window(folders, prefilled):
    """With only sliding layers (2 layers, window 8) the last token's logits depend on its last
    2 * 7 + 1 tokens and on nothing older, bit for bit; a global layer sees everything. The long
    prompt prefills through the batched (prefill-block) path, the short one attends row by row."""
    length = 100 if prefilled else 40
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, 250, length)]

    def last_logits(backend: TorchBackend, prompt: list[int]) -> np.ndarray:
        cache = backend.new_cache()
        if prefilled:
            backend.prefill(prompt[:-1], cache)
            return backend.forward(prompt[-1:], cache)[-1]
        return backend.forward(prompt, cache)[-1]

    def changed(at: int) -> list[int]:
        return tokens[:at] + [tokens[at] + 1] + tokens[at + 1 :]

    sliding = TorchBackend(load_torch_model(folders["sliding"], device="cpu"))
    field = 2 * (WINDOW - 1) + 1
    base = last_logits(sliding, tokens)
    assert np.array_equal(last_logits(sliding, changed(length - field - 1)), base)
    assert not np.array_equal(last_logits(sliding, changed(length - field)), base)
    mixed = TorchBackend(load_torch_model(folders["mixed"], device="cpu"))
    assert not np.array_equal(last_logits(mixed, changed(length - field - 1)), last_logits(mixed, tokens))


def test_verify_rows_equal_steps_across_the_window_and_rollback(tiny):
    """Rows of one pass (positions 5..20: the window's edge is inside it) equal one-row steps, also
    after rollbacks that cut the cache back past the window."""
    tokens = [int(t) for t in np.random.default_rng(4).integers(3, 250, 40)]
    cache = tiny.new_cache()
    tiny.prefill(tokens[:5], cache)
    base = tiny.checkpoint(cache)
    steps = [tiny.forward([t], cache)[0].copy() for t in tokens[5:35]]
    tiny.rollback(cache, base, 0)
    wide = tiny.forward(tokens[5:21], cache)
    assert all(np.array_equal(wide[j], steps[j]) for j in range(16))
    tiny.rollback(cache, base, 3)  # keep positions 5..7, redo from 8 (the first row that slides)
    assert np.array_equal(tiny.forward(tokens[8:24], cache), np.stack(steps[3:19]))
    tiny.truncate(cache, 5)
    assert np.array_equal(tiny.forward(tokens[5:35], cache), np.stack(steps))


def test_tiny_drafted_equals_serial(folders):
    engine = build_engine(folders["mixed"], backend="torch", device="cpu")
    assert engine.exactness.max_width > 1, engine.exactness.describe()
    prompt = engine.tokenizer.encode(TINY_PROMPT * 2)
    assert len(prompt) > 4 * WINDOW
    for params in (GREEDY, SAMPLED):
        assert_drafted_equals_serial(engine, prompt, params, max_tokens=40)  # asserts drafts were verified


def test_prefill_plan_is_kept_and_the_cache_grows_lazily(tiny):
    """A chunk stepped layer by layer equals the one-call prefill of it; a prompt resumed from a
    snapshot at a plan boundary equals the fresh one cut there (sessions' contract); the cache
    holds no rows before the first pass and only whole blocks after it."""
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, 250, 300)]
    one_call = tiny.new_cache()
    with torch.inference_mode(), torch_cpu.prefill_chunk():
        tiny.model(torch.tensor(tokens[:150]), one_call.layers, 0, logits=False)
    one_call.tokens.extend(tokens[:150])
    stepped = tiny.new_cache()
    assert stepped.nbytes() == 0
    for _ in tiny.prefill_steps(tokens[:150], stepped):
        pass
    _assert_same_cache(tiny, stepped, one_call)
    assert all(layer.capacity == 256 for layer in stepped.layers)
    assert tiny.describe()["windowed_attention"] == "block32"  # its blocks decide prefill bytes: snapshot key

    fresh = tiny.new_cache()
    tiny.prefill(tokens, fresh, boundaries=[70, 200])
    first = tiny.new_cache()
    tiny.prefill(tokens[:70], first)
    resumed = tiny.arrays_to_cache(*tiny.cache_to_arrays(first))
    tiny.prefill(tokens[70:], resumed, boundaries=[200])
    _assert_same_cache(tiny, resumed, fresh)
    assert np.array_equal(tiny.forward([9], resumed), tiny.forward([9], fresh))


def _assert_same_cache(backend: TorchBackend, a, b) -> None:
    arrays_a, _ = backend.cache_to_arrays(a)
    arrays_b, _ = backend.cache_to_arrays(b)
    assert arrays_a.keys() == arrays_b.keys()
    assert all(np.array_equal(arrays_a[k], arrays_b[k]) for k in arrays_a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_windowed_attention_matches_cpu_and_drafts_exactly(folders):
    """On CUDA a sliding layer's rows run the Triton kernel over their own window's keys."""
    cpu = TorchBackend(load_torch_model(folders["mixed"], device="cpu"), quant="none")
    engine = build_engine(folders["mixed"], backend="torch", device="cuda", dtype="float32")
    tokens = list(range(40, 140))
    for width in (100, 60):  # batched prefill blocks, then rows alone
        a = engine.backend.forward(tokens[:width], engine.backend.new_cache())
        b = cpu.forward(tokens[:width], cpu.new_cache())
        assert float(np.abs(a - b).max()) < 1e-3 * float(np.abs(b).max())
    assert engine.exactness.max_width > 1, engine.exactness.describe()
    assert_drafted_equals_serial(engine, engine.tokenizer.encode(TINY_PROMPT * 2), GREEDY, max_tokens=40)


# --- the real Gemma 3 270M ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_torch(gemma3_folder) -> Engine:
    """Gemma 3 270M on the torch backend (int8 linear layers, the default on CPU)."""
    return build_engine(gemma3_folder, backend="torch", device="cpu", max_width=8)


@pytest.mark.slow  # loading the model on both backends is ~40 s here
def test_real_gemma3_agrees_with_mlx(gemma3_folder, gemma3_torch):
    """Not bit-equal backends (each rounds its int8 activations its own way: torch keeps 8 bits
    per block of 64), but the same model: the first position's top-1 agrees, and the greedy
    replies agree until a position where the model is undecided, its two choices within
    NEAR_TIE logits of each other on both backends (this one's fibonacci reply parts at its
    4th token, 0.28 and 0.02 logits apart)."""
    mlx = Engine(MLXBackend(load_model(gemma3_folder)), gemma3_torch.tokenizer, gemma3_torch.eos_token_ids)
    config = GenerationConfig(max_tokens=6, draft=False)
    near_tie = 0.5
    for text in ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"):
        ids = gemma3_torch.tokenizer.encode(text)
        ours = gemma3_torch.backend.forward(ids, gemma3_torch.backend.new_cache())
        theirs = mlx.backend.forward(ids, mlx.backend.new_cache())
        assert ours[-1].argmax() == theirs[-1].argmax() and ours[0].argmax() == theirs[0].argmax()
        mine, other = gemma3_torch.generate(ids, config).tokens, mlx.generate(ids, config).tokens
        parted = next((j for j, (a, b) in enumerate(zip(mine, other, strict=True)) if a != b), None)
        if parted is not None:
            context = ids + mine[:parted]
            for backend in (gemma3_torch.backend, mlx.backend):
                row = backend.forward(context, backend.new_cache())[-1]
                assert abs(float(row[mine[parted]]) - float(row[other[parted]])) < near_tie, (text, parted)
    counting = gemma3_torch.generate(gemma3_torch.tokenizer.encode("1, 2, 3, 4, 5, 6,"), config)
    assert counting.text.startswith(" 7, 8"), counting.text  # and the model they agree on is sane


@pytest.mark.slow
def test_real_gemma3_drafted_equals_serial_past_the_window(gemma3_torch):
    """A prompt longer than the 512-token window: drafts are verified and the reply is serial's."""
    assert gemma3_torch.exactness.drafting, gemma3_torch.exactness.describe()
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n" * 24
    ids = gemma3_torch.tokenizer.encode(text + "def fib(n):")
    assert len(ids) > 600
    for params in (GREEDY, SAMPLED):
        assert assert_drafted_equals_serial(gemma3_torch, ids, params, max_tokens=24) > 0
