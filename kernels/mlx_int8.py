"""Row-exact linear layers by construction for MLX (CPU BLAS and Metal): integer-valued operands.

The arithmetic is `kernels.int8_linear`'s version 1 (int8 weights per output channel, activations
as 16-bit integers per row split into two int8 halves, without the torch path's 8-bit blocks,
which pay only in its AVX-512 kernel), run through MLX's stock float32 matmul:
the operands are integers in [-128, 127] held in float32, and K is cut into chunks of at most
1024, so every product and every partial sum of a chunk is an integer below 2^24 and is exact in
float32 whatever blocking, vector width, thread count or summation order the GEMM uses (OpenBLAS
on any x86 or ARM CPU, Accelerate, Metal). Chunk sums are added as int32; the rest is
per-element IEEE arithmetic. So row j of a k-row pass has the bits of a one-row step by
construction, not by the luck of a BLAS micro-kernel.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

VERSION = 1  # bump when the arithmetic changes (it is part of snapshot keys)
WEIGHT_LEVELS = 127
HALF = 256
ACT_LEVELS = 127 * HALF
K_CHUNK = 1024  # 1024 * 128 * 127 < 2^24: a chunk's sums are exact in float32


def quantize_weight(weight: mx.array) -> tuple[list[mx.array], mx.array]:
    """A float weight [N, K] as int8 values per output channel (held in float32), cut along K into
    contiguous chunks of at most K_CHUNK columns, and its float32 scales [N]."""
    w = weight.astype(mx.float32)
    scales = mx.max(mx.abs(w), axis=1) / WEIGHT_LEVELS
    scales = mx.where(scales > 0, scales, mx.ones_like(scales))
    values = mx.clip(mx.round(w / scales[:, None]), -WEIGHT_LEVELS, WEIGHT_LEVELS)
    k = w.shape[1]
    chunks = [mx.contiguous(values[:, start : start + K_CHUNK]) for start in range(0, k, K_CHUNK)]
    mx.eval(chunks, scales)
    return chunks, scales


def quantize_rows(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [m, K] as integer-valued float32 halves [2m, K] (hi rows, then lo rows) and scales [m, 1]."""
    xf = x.astype(mx.float32)
    # |x / scale| <= ACT_LEVELS up to one rounding, so no clip; a zero row gets a tiny scale and q = 0
    scales = mx.maximum(mx.max(mx.abs(xf), axis=1, keepdims=True), 1e-30) * (1.0 / ACT_LEVELS)
    q = mx.round(xf / scales)
    hi = mx.floor((q + HALF // 2) * (1.0 / HALF))  # a power-of-two scale: exact
    lo = q - hi * HALF
    return mx.concatenate([hi, lo]), scales


def linear(x: mx.array, chunks: list[mx.array], weight_scales: mx.array) -> mx.array:
    """x [m, K] times the chunked int8 weight's transpose -> float32 [m, N], row-exact."""
    m = x.shape[0]
    halves, row_scales = _quantized(x)
    if len(chunks) == 1:  # the sums are exact integers below 2^24 in float32 already
        sums = mx.matmul(halves, chunks[0].T)
    else:
        sums = None
        start = 0
        for chunk in chunks:
            part = mx.matmul(halves[:, start : start + chunk.shape[1]], chunk.T).astype(mx.int32)
            sums = part if sums is None else sums + part
            start += chunk.shape[1]
    return _combine(sums[:m], sums[m:], row_scales, weight_scales)


def _combine_rows(hi: mx.array, lo: mx.array, row_scales: mx.array, weight_scales: mx.array) -> mx.array:
    """float(256 * hi + lo) * row scale * weight scale, per element."""
    return (hi.astype(mx.float32) * HALF + lo.astype(mx.float32)) * row_scales * weight_scales


# The per-element steps as fused kernels (one per function, any shape): the same IEEE operations
# per element as the plain graph, without a dozen dispatches per layer. Checked equal, and
# row-exact, in tests/kernels/test_int8_kernels.py.
_quantize_compiled = mx.compile(quantize_rows, shapeless=True)
_combine = mx.compile(_combine_rows, shapeless=True)


_last: tuple[Any, Any] = (None, None)


def _quantized(x: mx.array) -> tuple[mx.array, mx.array]:
    """quantize_rows(x), reusing the last result when the same input array comes again (q, k and v
    projections, gate and up, read one input: it is quantized once). MLX arrays are immutable."""
    global _last
    last_input, last_result = _last
    if last_input is x:
        return last_result
    result = _quantize_compiled(x)
    _last = (x, result)
    return result


class ExactLinear(nn.Module):
    """Stands in for an mlx `Linear` / `QuantizedLinear`: same call, int8 arithmetic."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.chunks, self.scales = quantize_weight(weight)
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        y = linear(x if x.ndim == 2 else _flat(x), self.chunks, self.scales)
        if self.bias is not None:
            y = y + self.bias.astype(mx.float32)
        return y.reshape(*shape[:-1], self.out_features).astype(x.dtype)


class ExactHeadEmbedding(nn.Module):
    """A tied embedding: the lookup stays the model's own, `as_linear` (the output head) is exact."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = ExactLinear(_float_weight(embedding))

    def __call__(self, ids: mx.array) -> mx.array:
        return self.embedding(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.head(x)


_flat_last: tuple[Any, Any] = (None, None)


def _flat(x: mx.array) -> mx.array:
    """x as [rows, K]; the same input gives the same flattened array object (so `_quantized` sees it)."""
    global _flat_last
    last_input, last_flat = _flat_last
    if last_input is x:
        return last_flat
    flat = x.reshape(-1, x.shape[-1])
    _flat_last = (x, flat)
    return flat


def _float_weight(module: nn.Module) -> mx.array:
    if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                             mode=getattr(module, "mode", "affine"))
    return module.weight


def install(model: nn.Module) -> int:
    """Replace every linear layer of an mlx-lm `model` (and a tied output head) in place; returns
    how many were replaced. A second call finds nothing left to replace."""
    replaced = 0

    def visit(parent: Any) -> None:
        nonlocal replaced
        items = parent.items() if isinstance(parent, dict) else enumerate(parent)
        for key, child in list(items):
            if isinstance(child, nn.Linear | nn.QuantizedLinear):
                parent[key] = ExactLinear(_float_weight(child), child.get("bias"))
                replaced += 1
            elif isinstance(child, nn.Module | dict | list):
                if isinstance(child, ExactLinear | ExactHeadEmbedding):
                    continue
                visit(child)

    visit(model)
    inner = getattr(model, "model", None)
    if _ties_head(model) and inner is not None and isinstance(inner.embed_tokens, nn.Embedding | nn.QuantizedEmbedding):
        inner.embed_tokens = ExactHeadEmbedding(inner.embed_tokens)
        replaced += 1
    mx.eval(model.parameters())
    return replaced


def _ties_head(model: nn.Module) -> bool:
    args = getattr(model, "args", None)
    return bool(getattr(model, "tie_word_embeddings", False) or getattr(args, "tie_word_embeddings", False))
