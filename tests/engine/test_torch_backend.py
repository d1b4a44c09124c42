"""The torch backend: same logits as MLX, drafted == serial, resumed == fresh, clear load errors.

The real SmolLM2-135M (GGUF) runs on CPU through `TorchBackend`; random tiny Llama / Qwen3 /
Qwen3-MoE / Qwen2-MoE folders (tests/torch_tiny.py) cover the other code paths and are checked
against mlx-lm's implementations of the same architectures. The decode loop's depth is pinned to
the widest row-exact pass, so every drafted test really verifies drafts (and asserts some were
accepted: a broken verify path cannot pass by drafting nothing). CUDA tests need a GPU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

# isort: split
import numpy as np
import pytest
import torch

from agentfold.cli import main as cli_main
from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.drafters import DraftModelDrafter, SuffixLookupDrafter
from agentfold.engine.factory import build_engine
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.mlx.loader import ModelLoadError, load_model
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model
from agentfold.engine.torch.models.qwen3_moe import ReferenceExperts, moe_blocks
from agentfold.sessions import SessionManager
from tests.conftest import chat_ids
from tests.helpers.drafting import PinnedDepth
from tests.helpers.torch_tiny import CHATML, TINY_PROMPT, write_folder

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, seed=2)
CODE = """def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def scale(x, factor):
    return clamp(x * factor, 0, 255)
"""
CODE_EDIT = f"Rename the parameter `x` to `value` everywhere in this code and show the whole code.\n\n```python\n{CODE}```"
ANSWER_START = "```python\ndef clamp(value, low, high):\n"  # the reply's first line, so samples stay on the code


def pinned(engine: Engine, drafter=None) -> Engine:
    """The same backend and self-check, a fresh drafter, and a depth that always drafts."""
    clone = Engine(engine.backend, engine.tokenizer, engine.eos_token_ids, drafter=drafter or SuffixLookupDrafter(),
                   exactness=engine.exactness)
    clone.controller = PinnedDepth(max_depth=clone.controller.max_depth)
    return clone


def assert_drafted_equals_serial(engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int,
                                 drafter=None) -> int:
    """Drafted reply == serial reply; returns how many drafts were accepted."""
    serial = engine.generate(prompt, GenerationConfig(params=params, max_tokens=max_tokens, draft=False))
    drafted = pinned(engine, drafter).generate(prompt, GenerationConfig(params=params, max_tokens=max_tokens))
    assert drafted.tokens == serial.tokens and drafted.text == serial.text
    assert drafted.stats.drafted > 0
    return drafted.stats.accepted


# --- SmolLM2-135M (GGUF) on CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_torch(smollm2_gguf: Path) -> Engine:
    return build_engine(smollm2_gguf, backend="torch", device="cpu")


def test_smollm2_logits_match_mlx(smollm2_gguf, smollm2_torch):
    """Float weights: the two backends compute the same model. Quantized (the default on both: torch
    on the file's Q4_1 blocks with int8 activations per block of 32, MLX on int8 weights): rounded
    differently, so close but not bit-equal: wherever the float model's top two tokens are half a
    logit apart or more, both pick its token."""
    prompt = chat_ids(smollm2_torch.tokenizer, "Write a Python function that reverses a string.")
    mlx = MLXBackend(load_model(smollm2_gguf), quant="none")
    torch_float = TorchBackend(load_torch_model(smollm2_gguf, device="cpu"), quant="none")
    ours = torch_float.forward(prompt, torch_float.new_cache())
    theirs = mlx.forward(prompt, mlx.new_cache())
    assert ours.shape == theirs.shape == (len(prompt), 49152)
    assert float(np.abs(ours - theirs).max()) < 1e-3
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    config = GenerationConfig(max_tokens=8, draft=False)
    mlx_engine = Engine(mlx, smollm2_torch.tokenizer, smollm2_torch.eos_token_ids)
    float_engine = Engine(torch_float, smollm2_torch.tokenizer, smollm2_torch.eos_token_ids)
    assert float_engine.generate(prompt, config).tokens == mlx_engine.generate(prompt, config).tokens

    mlx_int8 = MLXBackend(load_model(smollm2_gguf))
    a = smollm2_torch.backend.forward(prompt, smollm2_torch.backend.new_cache())
    b = mlx_int8.forward(prompt, mlx_int8.new_cache())
    top_two = np.sort(theirs, axis=-1)[:, -2:]
    decided = top_two[:, 1] - top_two[:, 0] >= 0.5
    assert decided.sum() > 0.75 * len(prompt)
    for quantized in (a, b):
        assert np.array_equal(quantized.argmax(-1)[decided], theirs.argmax(-1)[decided])


def test_smollm2_selfcheck_allows_wide_passes(smollm2_torch):
    report = smollm2_torch.exactness
    assert smollm2_torch.backend.name == "torch" and not smollm2_torch.backend.has_recurrent_state
    assert report.max_width > 1, report.describe()
    assert all(report.checked[w] for w in range(2, report.max_width + 1))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.7-seed2"])
def test_smollm2_code_edit_drafted_equals_serial(smollm2_torch, params):
    tokenizer = smollm2_torch.tokenizer
    prompt = chat_ids(tokenizer, CODE_EDIT) + tokenizer.encode(ANSWER_START, add_special_tokens=False)
    assert assert_drafted_equals_serial(smollm2_torch, prompt, params, max_tokens=40) > 0


def test_smollm2_resumed_equals_fresh(smollm2_torch, tmp_path):
    """Turn 2 restored from turn 1's snapshot (same store, then a new store on the same disk)
    gives the reply of a fresh manager with an empty home."""
    engine = smollm2_torch
    serial = GenerationConfig(max_tokens=8, draft=False)
    manager = SessionManager(engine, tmp_path / "home")
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    first, info = manager.reply(messages, serial)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now make it subtract."}]
    with tempfile.TemporaryDirectory() as home:
        fresh, fresh_info = SessionManager(engine, home).reply(messages, serial)
    assert fresh_info.cached_tokens == 0
    resumed, resumed_info = manager.reply(messages, GenerationConfig(max_tokens=8), info.session_id)
    restarted, restarted_info = SessionManager(engine, tmp_path / "home").reply(messages, serial, info.session_id)
    assert resumed.tokens == restarted.tokens == fresh.tokens
    for turn in (resumed_info, restarted_info):
        assert turn.snapshot_id is not None and turn.cached_tokens > 0


# --- tiny random models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch-tiny")
    folders = {kind: write_folder(root / kind, kind, seed=10 + i)
               for i, kind in enumerate(("llama", "qwen3", "qwen3_moe", "qwen2_moe"))}
    folders["llama-draft"] = write_folder(root / "llama-draft", "llama", seed=10, noise=0.05)
    return folders


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_tiny_logits_match_mlx_lm(tiny_folders, kind):
    """mlx-lm's implementation of the same architecture is an independent reference (float weights
    on both sides); the int8 arithmetic of both backends stays close to it."""
    tokens = list(range(40, 100))
    float_ours = TorchBackend(load_torch_model(tiny_folders[kind], device="cpu"), quant="none")
    float_theirs = MLXBackend(load_model(tiny_folders[kind]), quant="none")
    b = float_theirs.forward(tokens, float_theirs.new_cache())
    a = float_ours.forward(tokens, float_ours.new_cache())
    assert float(np.abs(a - b).max()) < 1e-4 * float(np.abs(b).max())
    for quantized in (TorchBackend(load_torch_model(tiny_folders[kind], device="cpu")),
                      MLXBackend(load_model(tiny_folders[kind]))):
        assert quantized.describe()["linear"].startswith(("int8_linear", "mlx_int8"))
        c = quantized.forward(tokens, quantized.new_cache())
        assert float(np.abs(c - b).max()) < 0.05 * float(np.abs(b).max())


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "qwen2_moe"])
def test_tiny_drafted_equals_serial(tiny_folders, kind):
    engine = build_engine(tiny_folders[kind], backend="torch", device="cpu")
    assert engine.exactness.max_width > 1, engine.exactness.describe()
    prompt = engine.tokenizer.encode(TINY_PROMPT)
    accepted = sum(assert_drafted_equals_serial(engine, prompt, params, max_tokens=40) for params in (GREEDY, SAMPLED))
    assert accepted > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cpu_cache_rows_do_not_depend_on_how_the_prefill_was_cut(tiny_folders, kind):
    """On the CPU int8 path every kernel of a pass is row-exact at any width, prefill chunks
    included (the lane attention runs them too): a prefill in one chunk, cut elsewhere, decoded
    token by token or run as one wide pass stores the same cache bits."""
    from agentfold.kernels import native

    if not native.expected():
        pytest.skip("no C compiler: prefill chunks take the batched torch blocks")
    backend = TorchBackend(load_torch_model(tiny_folders[kind], device="cpu"))
    assert backend.quant == "int8"
    tokens = [(7 * i + 3) % 200 + 20 for i in range(150)]
    whole = backend.new_cache()
    backend.prefill(tokens, whole)
    cut = backend.new_cache()
    backend.prefill(tokens, cut, [17, 64, 65, 130])
    stepped = backend.new_cache()
    backend.prefill(tokens[:100], stepped)
    for token in tokens[100:]:
        backend.forward([token], stepped)
    wide = backend.new_cache()
    backend.prefill(tokens[:80], wide)
    backend.forward(tokens[80:], wide)
    for other in (cut, stepped, wide):
        for a, b in zip(whole.layers, other.layers, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.read(150), b.read(150), strict=True))


def test_tiny_draft_model_drafter(tiny_folders):
    """A torch draft model (a perturbed copy of the target) drafts; the reply is still serial's."""
    engine = build_engine(tiny_folders["llama"], backend="torch", device="cpu")
    prompt = engine.tokenizer.encode(TINY_PROMPT)
    draft = TorchBackend(load_torch_model(tiny_folders["llama-draft"], device="cpu"))
    for params in (GREEDY, SAMPLED):
        assert assert_drafted_equals_serial(engine, prompt, params, 30, DraftModelDrafter(draft)) > 0


def test_moe_blocks_expose_swappable_experts(tiny_folders):
    loaded = load_torch_model(tiny_folders["qwen3_moe"], device="cpu")
    blocks = moe_blocks(loaded.model)
    assert [b.layer_index for b in blocks] == [0]  # layer 1 is in mlp_only_layers
    block = blocks[0]
    assert isinstance(block.experts, ReferenceExperts) and block.weights.gate_proj.shape == (4, 32, 64)
    x = torch.randn(5, 64)
    ids, gates = block.route(x)
    assert ids.dtype == torch.int64 and gates.dtype == torch.float32 and ids.shape == gates.shape == (5, 2)
    assert torch.allclose(gates.sum(-1), torch.ones(5))
    calls = []

    def spy(rows, row_ids, row_gates):  # any callable with the contract's signature can stand in
        calls.append(rows.shape[0])
        return ReferenceExperts(block.weights)(rows, row_ids, row_gates)

    backend = TorchBackend(loaded)
    before = backend.forward([5, 6, 7], backend.new_cache())
    block.experts = spy
    after = backend.forward([5, 6, 7], backend.new_cache())
    assert calls == [3] and np.array_equal(before, after)


def test_bfloat16_snapshot_round_trip(tiny_folders):
    backend = TorchBackend(load_torch_model(tiny_folders["qwen3"], dtype="bfloat16", device="cpu"))
    cache = backend.new_cache()
    backend.prefill(list(range(30, 60)), cache)
    arrays, layout = backend.cache_to_arrays(cache)
    restored = backend.arrays_to_cache(arrays, layout)
    assert restored.tokens == cache.tokens
    for a, b in zip(cache.layers, restored.layers, strict=True):
        assert a.keys.dtype == b.keys.dtype == torch.bfloat16
        assert torch.equal(a.read(30)[0], b.read(30)[0]) and torch.equal(a.read(30)[1], b.read(30)[1])
    assert np.array_equal(backend.forward([61], cache), backend.forward([61], restored))


def test_tiny_sessions_resume_on_torch(tiny_folders, tmp_path):
    engine = build_engine(tiny_folders["qwen3_moe"], backend="torch", device="cpu")
    engine.tokenizer.chat_template = CHATML
    config = GenerationConfig(max_tokens=12, draft=False)
    manager = SessionManager(engine, tmp_path / "home")
    messages = [{"role": "user", "content": "def add(a, b):\n"}]
    first, info = manager.reply(messages, config)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "for i in range(10):\n"}]
    resumed, resumed_info = manager.reply(messages, config, info.session_id)
    with tempfile.TemporaryDirectory() as home:
        fresh, _ = SessionManager(engine, home).reply(messages, config)
    assert resumed.tokens == fresh.tokens and resumed_info.cached_tokens > 0
    assert manager.key != SessionManager(build_engine(tiny_folders["qwen3_moe"], drafter="none"), tmp_path / "m").key


# --- errors -----------------------------------------------------------------------------------


def _break(folder: Path, tmp_path: Path, how: str) -> Path:
    import json
    import shutil

    bad = tmp_path / how
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    if how == "no-config":
        (bad / "config.json").unlink()
    elif how == "model-type":
        config["model_type"] = "mamba"
    elif how == "shape":
        config["intermediate_size"] = 96
    elif how == "no-weights":
        (bad / "model.safetensors").unlink()
    elif how == "missing-tensor":
        from safetensors.torch import load_file, save_file

        weights = load_file(str(bad / "model.safetensors"))
        del weights["model.layers.1.mlp.up_proj.weight"]
        save_file(weights, str(bad / "model.safetensors"))
    elif how == "not-safetensors":
        (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    if how != "no-config":
        (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("how,message", [
    ("no-config", "no config.json"), ("model-type", "'mamba' is not supported"), ("shape", "the config says"),
    ("no-weights", "no *.safetensors"), ("missing-tensor", "missing ['model.layers.1.mlp.up_proj.weight']"),
    ("not-safetensors", "unreadable safetensors"),
])
def test_bad_folders_fail_with_one_line(tiny_folders, tmp_path, how, message):
    with pytest.raises(ModelLoadError) as error:
        load_torch_model(_break(tiny_folders["llama"], tmp_path, how), device="cpu")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cli_errors_are_one_line(tiny_folders, tmp_path, capsys):
    bad = _break(tiny_folders["llama"], tmp_path, "model-type")
    assert cli_main(["generate", "--backend", "torch", "--model", str(bad), "hi"]) == 2
    assert cli_main(["generate", "--backend", "torch", "--model", str(tmp_path / "none.txt"), "hi"]) == 2
    if not torch.cuda.is_available():
        assert cli_main(["generate", "--backend", "torch", "--device", "cuda", "hi"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentfold: error:")]
    assert len(lines) == (3 if not torch.cuda.is_available() else 2)
    assert "'mamba' is not supported" in lines[0]
    with pytest.raises(ValueError, match="backend must be one of auto, mlx, torch"):
        build_engine(tiny_folders["llama"], backend="jax")


# --- CUDA ---------------------------------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_cuda_matches_cpu_and_is_row_exact(tiny_folders, kind):
    cpu = TorchBackend(load_torch_model(tiny_folders[kind], device="cpu"))
    engine = build_engine(tiny_folders[kind], backend="torch", device="cuda", dtype="float32")
    gpu = engine.backend
    assert gpu.device.type == "cuda"
    tokens = list(range(40, 100))
    a, b = gpu.forward(tokens, gpu.new_cache()), cpu.forward(tokens, cpu.new_cache())
    assert float(np.abs(a - b).max()) < 1e-3 * float(np.abs(b).max())
    assert engine.exactness.max_width == 16, engine.exactness.describe()
    prompt = engine.tokenizer.encode(TINY_PROMPT)
    assert assert_drafted_equals_serial(engine, prompt, GREEDY, max_tokens=40) > 0


@CUDA
def test_cuda_bfloat16_smollm2(smollm2_gguf):
    engine = build_engine(smollm2_gguf, backend="torch", device="cuda")
    assert engine.backend.loaded.dtype == "bfloat16" and engine.exactness.max_width > 1
    prompt = chat_ids(engine.tokenizer, CODE_EDIT)
    assert assert_drafted_equals_serial(engine, prompt, GREEDY, max_tokens=64) > 0


def test_both_backends_implement_the_protocol(tiny_folders):
    """The decode loop, self-check and session store are typed against `engine.protocol.Backend`:
    both backends provide every member with the protocol's parameter names."""
    import inspect

    from agentfold.engine.protocol import Backend

    members = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
    assert {"forward", "prefill", "rollback", "cache_to_arrays", "arrays_to_cache", "describe"} <= set(members)
    for backend in (TorchBackend(load_torch_model(tiny_folders["llama"], device="cpu")),
                    MLXBackend(load_model(tiny_folders["llama"]))):
        assert isinstance(backend, Backend), type(backend).__name__
        for name in members:
            ours = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
            theirs = list(inspect.signature(getattr(backend, name)).parameters)
            assert theirs == ours, (type(backend).__name__, name, theirs)
        cache = backend.new_cache()
        backend.prefill(list(range(40, 60)), cache, boundaries=[45])
        assert cache.length == 20 and backend.forward([60, 61], cache).shape[0] == 2


def _one_shot_prefill(backend, tokens: list[int]):
    """The chunk the way prefill ran before it was stepped: one call, one evaluation of every layer."""
    cache = backend.new_cache()
    if isinstance(backend, MLXBackend):
        import mlx.core as mx

        backend._run(tokens, cache)
        mx.eval([layer.state for layer in cache.layers])
    else:
        from agentfold.kernels import torch_cpu

        with torch.inference_mode(), torch_cpu.prefill_chunk():
            backend.model(torch.tensor(tokens), cache.layers, 0, logits=False)
        cache.tokens.extend(tokens)
    return cache


def _hybrid_mlx_backend() -> MLXBackend:
    from tests.helpers.tiny_models import build_model, loaded_model, make_tokenizer, tiny_config

    tokenizer = make_tokenizer()
    config = tiny_config("qwen3_next", len(tokenizer))
    return MLXBackend(loaded_model(build_model(config, seed=3), tokenizer, config, Path(tempfile.mkdtemp())))


@pytest.mark.parametrize("name", ["torch-llama", "torch-qwen3_moe", "mlx-llama", "mlx-qwen3_moe", "mlx-hybrid"])
def test_prefill_steps_are_layers_that_others_can_run_between(tiny_folders, name):
    """A prefill chunk runs one layer per step. Another cache's verify pass between the steps gets
    the logits it gets alone (the prefill kernels are scoped to the step), and the chunk ends bit for
    bit as the one-call prefill left it, whichever way it is stepped."""
    kind = name.split("-", 1)[1]
    if name == "mlx-hybrid":
        backend = _hybrid_mlx_backend()
    elif name.startswith("torch"):
        backend = TorchBackend(load_torch_model(tiny_folders[kind], device="cpu"))
    else:
        backend = MLXBackend(load_model(tiny_folders[kind]))
    chunk = [int(t) for t in np.random.default_rng(7).integers(3, 250, 150)]  # wider than the per-row limit
    expected, _ = backend.cache_to_arrays(_one_shot_prefill(backend, chunk))

    other = backend.new_cache()
    backend.prefill([5, 9, 11, 13], other)
    alone = backend.forward([17, 19, 23], backend.arrays_to_cache(*backend.cache_to_arrays(other)))
    cache = backend.new_cache()
    between = []
    for _ in backend.prefill_steps(chunk, cache):
        between.append(backend.forward([17, 19, 23], backend.arrays_to_cache(*backend.cache_to_arrays(other))))
    assert len(between) == len(cache.layers) >= 2
    assert all(np.array_equal(logits, alone) for logits in between)
    arrays, _ = backend.cache_to_arrays(cache)
    assert arrays.keys() == expected.keys()
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected), name

    stopped = backend.new_cache()
    steps = backend.prefill_steps(chunk, stopped)
    next(steps)
    steps.close()  # a cancelled reply: the cache is still whole (unchanged, or holding the chunk)
    if stopped.length == 0:
        backend.prefill(chunk, stopped)
    arrays, _ = backend.cache_to_arrays(stopped)
    assert all(np.array_equal(arrays[k], expected[k]) for k in expected), name
