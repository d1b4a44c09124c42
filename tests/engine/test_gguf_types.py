"""GGUF loading is right for every type it accepts: each weight equals the gguf package's reference.

The reference is the gguf package's own reader (`GGUFReader`) and dequantization, applied to files
the package itself wrote (tests/helpers/gguf_files.py) and to the shipped models. Our reader
(`engine.gguf_file`) parses the header and maps the tensors itself, and both backends' loaders
undo llama.cpp's changes (q / k permutation, Gemma's 1 + w norms): every value must come out
bit-equal, which MLX's native GGUF read did not (Q4_K off by up to 1.90 on Qwen2.5-Coder).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType

from agentfold.engine.gguf_file import GGUFError, GGUFFile, readable
from agentfold.engine.gguf_model import open_gguf
from tests.helpers.gguf_files import (
    add,
    block_bytes,
    llamacpp_permute,
    reference,
    tiny_tokenizer_fields,
    write_tiny_model,
)

# every block type the gguf package dequantizes, and the plain ones
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
         "MXFP4"]
UNREADABLE = ["Q8_K", "Q1_0"]  # types with block sizes but no dequantization in the gguf package


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GGUF holding a tensor of every type, in odd shapes (rows not a power of two, 3-D too)."""
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    rng = np.random.default_rng(7)
    writer = GGUFWriter(str(path), "llama")
    for i, kind in enumerate(TYPES):
        add(writer, f"t.{kind}", block_bytes(kind, 3 + i % 5, 512, rng), kind)
    add(writer, "t.Q4_K.odd_rows", block_bytes("Q4_K", 17, 768, rng), "Q4_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_type_reads_as_the_reference(every_type: Path):
    ours = GGUFFile(every_type)
    theirs = GGUFReader(str(every_type))
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for name, info in ours.tensors.items():
        assert readable(info.type_name), info.type_name
        want = reference(theirs, name)
        got = ours.values(name)
        assert got.shape == want.shape, name
        assert np.array_equal(bits(got), bits(want)), f"{name}: values differ from gguf's dequantization"
        assert np.isfinite(want).all() and np.abs(want).max() > 0, f"{name}: a degenerate probe"


@pytest.mark.parametrize("kind", UNREADABLE)
def test_a_type_it_cannot_read_is_one_line_naming_it(tmp_path: Path, kind: str):
    path = tmp_path / "bad.gguf"
    qtype = GGMLQuantizationType[kind]
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 2 * size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError) as error:
        GGUFFile(path).check_readable()
    message = str(error.value)
    assert "\n" not in message and kind in message and "blk.0.attn_q.weight" in message


def test_truncated_file_is_one_line(every_type: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(every_type.read_bytes()[: every_type.stat().st_size // 2])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(cut)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> dict:
    return tiny_tokenizer_fields()


# llama (q / k permuted) in every common type; the other architectures' own changes in two each
MODEL_CASES = [*(("llama", kind) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                              "IQ4_XS", "F16")),
               ("qwen2", "Q4_K"), ("qwen2", "Q6_K"), ("gemma3", "Q4_K"), ("gemma3", "Q5_0")]


def expected_hf(reader: GGUFReader, gguf_name: str, arch: str, heads: int, kv_heads: int) -> np.ndarray:
    """What the HF weight must be, from the reference: llama's q / k un-permuted (checked by permuting
    the loaded weight back, with llama.cpp's own definition), Gemma's norms minus 1."""
    values = reference(reader, gguf_name)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values


@pytest.mark.parametrize(("arch", "kind"), MODEL_CASES)
def test_model_weights_equal_reference_on_both_backends(tmp_path: Path, tiny_tokenizer: dict, arch: str, kind: str):
    """A tiny model of each architecture with its linears in each type: the torch loader's float32
    weights and the MLX loader's are the reference's values, bit for bit, under HF names."""
    import mlx.core as mx

    from agentfold.engine.mlx.gguf import load_gguf
    from agentfold.engine.torch.loader import load_torch_model

    path = write_tiny_model(tmp_path / f"{arch}-{kind}.gguf", arch, kind, tiny_tokenizer, seed=len(kind))
    model = open_gguf(path)
    reader = GGUFReader(str(path))
    torch_params = dict(load_torch_model(path, "float32", "cpu").model.named_parameters())
    mlx_weights = load_gguf(path, "float32").weights
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    for hf_name, gguf_name in model.names.items():
        want = expected_hf(reader, gguf_name, arch, heads, kv_heads)
        for backend, got in (("torch", torch_params[hf_name].detach().numpy()),
                             ("mlx", np.array(mlx_weights[hf_name].astype(mx.float32)))):
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                got = llamacpp_permute(got, heads if ".q_proj." in hf_name else kv_heads)
            assert np.array_equal(bits(got), bits(want)), f"{backend}: {hf_name} ({model.source_type(hf_name)})"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_mlx_keep_is_exactly_the_reference(tmp_path: Path, tiny_tokenizer: dict, kind: str):
    """`convert --dtype keep`: MLX affine weights built from the blocks dequantize to the reference's
    values (scale * q + bias is exact in float32 for a float16 scale and a 4- or 8-bit q)."""
    import mlx.core as mx

    from agentfold.engine.mlx.gguf import load_gguf

    path = write_tiny_model(tmp_path / f"keep-{kind}.gguf", "llama", kind, tiny_tokenizer)
    model = open_gguf(path)
    reader = GGUFReader(str(path))
    loaded = load_gguf(path, "keep")
    assert loaded.quantization == {"group_size": 32, "bits": 8 if kind == "Q8_0" else 4}
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    checked = 0
    for hf_name, gguf_name in model.names.items():
        prefix = hf_name[: -len(".weight")]
        if f"{prefix}.scales" not in loaded.weights:
            continue
        got = np.array(mx.dequantize(loaded.weights[hf_name], loaded.weights[f"{prefix}.scales"],
                                     loaded.weights[f"{prefix}.biases"], group_size=32,
                                     bits=loaded.quantization["bits"]).astype(mx.float32))
        if ".q_proj." in hf_name or ".k_proj." in hf_name:
            got = llamacpp_permute(got, heads if ".q_proj." in hf_name else kv_heads)
        # equal values; a zero may carry the other sign (d * (q - 8) is -0 for a negative d, d * q - 8d is +0)
        assert np.array_equal(got, reference(reader, gguf_name)), hf_name
        checked += 1
    assert checked == 7 * model.config["num_hidden_layers"]


def shipped(name: str) -> Path:
    from agentfold.serve.models import ModelNotFound, default_model_path, gemma3_path

    try:
        return default_model_path() if name == "smollm2" else gemma3_path()
    except ModelNotFound as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_shipped_models_load_as_the_reference(name: str):
    """The real files (SmolLM2: Q4_1, Q8_0; Gemma 3: Q4_K, Q5_0, Q6_K, Q8_0): every tensor of the
    first and last layers and the embedding, through the loader's HF view, equal the reference."""
    path = shipped(name)
    model = open_gguf(path)
    reader = GGUFReader(str(path))
    last = model.config["num_hidden_layers"] - 1
    heads, kv_heads = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    kinds = set()
    for hf_name, gguf_name in model.names.items():
        if not (gguf_name.startswith(("blk.0.", f"blk.{last}.", "token_embd", "output"))):
            continue
        got = model.tensor(hf_name)
        if model.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            got = llamacpp_permute(got, heads if ".q_proj." in hf_name else kv_heads)
        assert np.array_equal(bits(got), bits(expected_hf(reader, gguf_name, model.architecture, heads, kv_heads))), \
            hf_name
        kinds.add(model.source_type(hf_name))
    assert kinds >= ({"Q4_1", "F32"} if name == "smollm2" else {"Q4_K", "Q6_K", "Q5_0", "F32"})
