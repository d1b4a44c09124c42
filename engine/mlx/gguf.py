"""A GGUF file as an mlx-lm model config, MLX weights and a Hugging Face tokenizer.

The file is read by `engine.gguf_model` (llama.cpp's names, permutations and Gemma's norm offset
undone; every tensor the gguf package's reference dequantization, whatever its type). MLX's own
GGUF reader is not used: its float results differ from the reference for every quantized type we
checked (Q4_K by up to 1.90 on Qwen2.5-Coder, Q4_1 and Q8_0 by float16 rounding), and it cannot
read Gemma's Q5_0 at all.

`dtype="keep"` keeps Q4_0 / Q4_1 / Q8_0 weights quantized, as MLX affine quantization (group 32),
built from the blocks' own integers and scales: MLX's dequantization `scale * q + bias` of them
gives the reference's values exactly (a zero may be +0 where the reference's d * (q - 8) is -0) (every product and sum is exact in float32: a float16 scale
times a 4- or 8-bit integer has at most 19 significant bits), which tests/engine/test_gguf_types.py
checks. Other types, or files that mix bit widths, load as float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from agentfold.engine.gguf_file import GGUFError
from agentfold.engine.gguf_model import build_tokenizer, open_gguf

__all__ = ["GGUFError", "GGUFModel", "build_tokenizer", "load_gguf"]

_GROUP = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block, MLX's group size
_KEEP_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face / mlx-lm terms."""

    config: dict[str, Any]
    weights: dict[str, mx.array]  # HF names; quantized ones carry .scales/.biases
    quantization: dict[str, int] | None  # {"group_size", "bits"} when weights stay quantized
    tokenizer: Any  # transformers.PreTrainedTokenizerFast


def _affine(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine (packed uint32 values, float32 scales, float32 biases) of Q4_0 / Q4_1 / Q8_0 blocks,
    such that scale * q + bias is the reference dequantization exactly."""
    rows = int(np.prod(shape[:-1]))
    blocks = raw.reshape(rows, shape[-1] // _GROUP, -1)
    d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[:, :, 2:].view(np.int8).astype(np.int32) + 128  # unsigned 0..255
        bias = -128.0 * d
        packed = q.astype(np.uint8).reshape(rows, -1).view(np.uint32)
        return packed.reshape(*shape[:-1], -1), d.reshape(*shape[:-1], -1), bias.reshape(*shape[:-1], -1)
    if kind == "Q4_1":
        bias = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[:, :, 4:]
    else:  # Q4_0: d * (q - 8)
        bias = -8.0 * d
        nibbles = blocks[:, :, 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.uint32)  # block order: low halves first
    q = q.reshape(rows, -1, 8)
    packed = np.zeros(q.shape[:-1], dtype=np.uint32)
    for i in range(8):
        packed |= q[..., i] << np.uint32(4 * i)
    return packed.reshape(*shape[:-1], -1), d.reshape(*shape[:-1], -1), bias.reshape(*shape[:-1], -1)


def _keep_bits(model: Any) -> int | None:
    """The one MLX bit width every quantized linear weight maps to exactly, or None (load floats)."""
    kinds = {model.source_type(name) for name in model.names if name.endswith(".weight") and
             len(model.file.tensors[model.names[name]].shape) == 2 and model.source_type(name) not in ("F32", "F16")}
    bits = {_KEEP_BITS.get(kind) for kind in kinds}
    return bits.pop() if len(bits) == 1 and None not in bits else None


def load_gguf(path: str | Path, dtype: str = "float32") -> GGUFModel:
    """Read `path` into a config, weights in `dtype` (or `keep`), and a tokenizer."""
    model = open_gguf(path)
    target = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "keep": mx.float32}[dtype]
    bits = _keep_bits(model) if dtype == "keep" else None
    weights: dict[str, mx.array] = {}
    for name in model.names:
        kind = model.source_type(name)
        if bits is not None and kind in _KEEP_BITS and name.endswith(".weight") and \
                name != "model.embed_tokens.weight":
            prefix = name[: -len(".weight")]
            info = model.file.tensors[model.names[name]]
            parts = _affine(model.file.raw(model.names[name]), kind, info.shape)
            for suffix, part in zip(("weight", "scales", "biases"), parts, strict=True):
                weights[f"{prefix}.{suffix}"] = mx.array(model.rows_in_hf_order(name, part))
            continue
        weights[name] = mx.array(model.tensor(name)).astype(target)
    config = dict(model.config)
    quantization = {"group_size": _GROUP, "bits": bits} if bits is not None else None
    if quantization:
        config["quantization"] = quantization
    tokenizer = build_tokenizer(model.metadata, model.architecture)
    return GGUFModel(config=config, weights=weights, quantization=quantization, tokenizer=tokenizer)
