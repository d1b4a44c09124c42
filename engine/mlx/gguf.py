"""Read a GGUF file into an mlx-lm model config, MLX weights and a Hugging Face tokenizer.

llama.cpp writes Hugging Face checkpoints into GGUF under its own tensor names, permutes the
q/k projections of llama-family models for its RoPE layout, adds 1 to Gemma's norm weights and
keeps the tokenizer as metadata. This module undoes each of those, so that the result loads
into the stock mlx-lm model classes and behaves like the original checkpoint.

Weights come from `mlx.core.load` (it reads F32/F16/Q4_0/Q4_1/Q8_0 natively, quantized ones as
MLX affine quantization with group 32); files with other quantizations (K-quants, Q5_0...) are
dequantized with the `gguf` package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

_SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into a model, with the reason."""


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face / mlx-lm terms."""

    config: dict[str, Any]
    weights: dict[str, mx.array]  # HF names; quantized ones carry .scales/.biases
    quantization: dict[str, int] | None  # {"group_size", "bits"} when weights stay quantized
    tokenizer: Any  # transformers.PreTrainedTokenizerFast


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def read_metadata(path: Path) -> tuple[dict[str, Any], dict[str, mx.array] | None]:
    """Metadata of a GGUF file, and its weights when MLX can read them natively."""
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
        return meta, weights
    except Exception:  # MLX cannot decode this quantization: fall back to the gguf package
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        meta = {name: field.contents() for name, field in reader.fields.items()}
        return meta, None


def _dequantize_with_gguf(path: Path) -> dict[str, mx.array]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    out = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        out[tensor.name] = mx.array(np.asarray(values, dtype=np.float32).reshape(shape))
    return out


def _config_from_metadata(meta: dict[str, Any], arch: str, has_output: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _scalar(meta, f"{arch}.{key}", default)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": not has_output,
    }
    head_dim = get("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    if arch == "gemma3":
        config.update(
            model_type="gemma3_text",
            head_dim=int(head_dim or hidden // n_heads),
            query_pre_attn_scalar=int(head_dim or hidden // n_heads),
            sliding_window=int(get("attention.sliding_window", 512)),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
        )
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos)
    bos = _scalar(meta, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    return config


def _unpermute(weight: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's q/k row permutation (it interleaves the RoPE halves per head)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return mx.swapaxes(w, 1, 2).reshape(rows, *rest)


def _rename(name: str, arch: str) -> str | None:
    base, _, suffix = name.rpartition(".")  # suffix: weight | bias | scales | biases
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", base)
    if match:
        table = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        part = table.get(match.group(2))
        if part is None:
            return None
        return f"model.layers.{match.group(1)}.{part}.{suffix}"
    top = _TOP_NAMES.get(base)
    return f"{top}.{suffix}" if top else None


def _convert_weights(raw: dict[str, mx.array], config: dict[str, Any], arch: str) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, value in raw.items():
        new = _rename(name, arch)
        if new is None:
            raise GGUFError(f"unexpected tensor {name!r} for architecture {arch}")
        if arch == "llama" and (".q_proj." in new or ".k_proj." in new):
            heads = config["num_attention_heads"] if ".q_proj." in new else config["num_key_value_heads"]
            value = _unpermute(value, heads)
        if arch == "gemma3" and new.endswith("norm.weight"):
            value = value - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights
        out[new] = value
    return out


def _quant_bits(weights: dict[str, mx.array], prefix: str) -> int:
    packed, scales = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    return packed.shape[-1] // scales.shape[-1]  # GGUF blocks are 32 wide: 32 * bits / 32


def _apply_dtype(weights: dict[str, mx.array], dtype: str) -> tuple[dict[str, mx.array], dict | None]:
    """Dequantize to `dtype`, or (`keep`) keep MLX-quantized weights when they share one scheme."""
    prefixes = sorted(k[: -len(".scales")] for k in weights if k.endswith(".scales"))
    if dtype == "keep" and prefixes:
        bits = {_quant_bits(weights, p) for p in prefixes}
        if len(bits) == 1:
            others = {k: v for k, v in weights.items()}
            return others, {"group_size": 32, "bits": bits.pop()}
        dtype = "float16"  # mixed schemes: fall through to a float copy
    target = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "keep": None}[dtype]
    out: dict[str, mx.array] = {}
    quantized = set(prefixes)
    for name, value in weights.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix in quantized:
            if suffix != "weight":
                continue
            bits = _quant_bits(weights, prefix)
            value = mx.dequantize(
                value, weights[f"{prefix}.scales"], weights[f"{prefix}.biases"], group_size=32, bits=bits
            )
        out[name] = value.astype(target) if target is not None else value
    return out, None


def build_tokenizer(meta: dict[str, Any], arch: str) -> Any:
    """A fast Hugging Face tokenizer rebuilt from GGUF metadata, chat template included."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = {
        name: _to_python(meta[f"tokenizer.{key}"])
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(arch, fields)
    tokens = fields["tokens"]

    def token(key: str) -> str | None:
        index = fields.get(key)
        return tokens[index] if index is not None else None

    add_bos = _scalar(meta, "tokenizer.ggml.add_bos_token", fields.get("tokenizer_type") == "llama")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=_to_python(meta.get("tokenizer.chat_template")),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unk_token_id"),
        pad_token=token("pad_token_id"),
        add_bos_token=bool(add_bos),
    )
    return tokenizer


def _to_python(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def load_gguf(path: str | Path, dtype: str = "float32") -> GGUFModel:
    """Read `path` into a config, weights in `dtype` (or `keep`), and a tokenizer."""
    path = Path(path)
    meta, native = read_metadata(path)
    arch = str(_to_python(meta.get("general.architecture", "")))
    if arch not in _SUPPORTED:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_SUPPORTED)})")
    raw = native if native is not None else _dequantize_with_gguf(path)
    has_output = any(k.startswith("output.") for k in raw)
    config = _config_from_metadata(meta, arch, has_output)
    weights = _convert_weights(raw, config, arch)
    weights, quantization = _apply_dtype(weights, dtype)
    if quantization:
        config["quantization"] = quantization
    tokenizer = build_tokenizer(meta, arch)
    return GGUFModel(config=config, weights=weights, quantization=quantization, tokenizer=tokenizer)
