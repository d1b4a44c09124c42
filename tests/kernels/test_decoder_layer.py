"""A decoder layer in one C call (`kernels/decoder_layer.py`, csrc/decoder_layer.c): the bits of the
modules' path, at any width, across lanes, on 1 and 2 threads, and only where it applies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model
from agentfold.kernels import block_linear, decoder_layer
from agentfold.kernels.decoder_layer import LayerKernel
from tests.helpers.gguf_files import tiny_tokenizer_fields, write_tiny_model

pytestmark = pytest.mark.skipif(decoder_layer.library() is None or not block_linear.supported("Q4_K", 256),
                                reason="no C compiler: no block kernels")

PROMPT = [5, 17, 42, 99, 3, 250, 18, 7, 64, 128, 11, 5, 17, 42, 99, 3, 77, 31]


@pytest.fixture(autouse=True)
def no_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFOLD_CACHE", str(tmp_path / "cache"))


def blocks_backend(tmp_path: Path, arch: str, kind: str, quant: str = "blocks") -> TorchBackend:
    path = write_tiny_model(tmp_path / f"{arch}-{kind}.gguf", arch, kind, tiny_tokenizer_fields(), seed=len(kind) + 1,
                            hidden=256, inner=768, layers=3, heads=4, kv_heads=1)
    return TorchBackend(load_torch_model(path, device="cpu", quant=quant), quant=quant)


def passes(backend: TorchBackend) -> list[np.ndarray]:
    """Logits of passes of 1, 3, 5 and 9 rows on one sequence, and of two lanes sharing a pass."""
    cache = backend.new_cache()
    logits = [backend.forward(PROMPT[:9], cache), backend.forward(PROMPT[9:12], cache),
              backend.forward(PROMPT[12:13], cache), backend.forward(PROMPT[13:], cache)]
    first, second = backend.new_cache(), backend.new_cache()
    backend.forward(PROMPT[:4], first)
    backend.forward(PROMPT[6:13], second)
    return logits + backend.forward_many([(PROMPT[4:7], first), (PROMPT[13:14], second)])


@pytest.mark.parametrize(("arch", "kind"), [("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen2", "Q4_K"),
                                            ("qwen2", "Q6_K"), ("qwen2", "Q5_0")])
def test_one_call_gives_the_modules_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, kind: str,
                                         threads: int):
    """Every pass's logits with the layers in one C call equal, bit for bit, the modules' (the same
    kernels one by one), Qwen2's q / k / v biases included; the C layer really ran."""
    backend = blocks_backend(tmp_path, arch, kind)
    layers = backend.model.model.layers
    assert all(isinstance(layer.kernel, LayerKernel) for layer in layers)
    calls = []
    run = LayerKernel.run
    monkeypatch.setattr(LayerKernel, "run", lambda self, *args: calls.append(1) or run(self, *args))
    in_one_call = passes(backend)
    assert len(calls) == 7 * len(layers)  # every layer of every pass (two of them are prompts)
    for layer in layers:
        layer.kernel = None
    by_modules = passes(backend)
    assert len(calls) == 7 * len(layers)
    for ours, theirs in zip(in_one_call, by_modules, strict=True):
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs)


def test_only_layers_it_computes_get_one(tmp_path: Path):
    """Gemma 3's layers (other norms, GELU, windows) and int8 weights keep the modules."""
    assert not any(getattr(layer, "kernel", None) for layer in blocks_backend(tmp_path, "gemma3", "Q4_K").model.model.layers)
    assert not any(layer.kernel for layer in blocks_backend(tmp_path, "llama", "Q4_K", quant="int8").model.model.layers)


def test_weights_that_do_not_fit_together_are_refused(tmp_path: Path):
    layer = blocks_backend(tmp_path, "llama", "Q4_0").model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    with pytest.raises(ValueError, match="do not fit together"):
        LayerKernel(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, 1e-6, attention.heads + 1,
                    attention.kv_heads, attention.head_dim, attention.scale, None, attention.qkv.weight, None,
                    attention.o_proj.quantized, None, mlp.gate_up.weight, mlp.down_proj.quantized)
