"""Several sequences' passes as one MLX pass (lanes), bit for bit what each gives alone.

A lane is one sequence's rows and its cache. The rows of all lanes are concatenated, so every
linear layer, norm and MLP runs once over all of them (one int8 matmul per weight instead of one
per lane: the weights are read once). Those operations are row-exact (`kernels.mlx_int8`, per-row
norms, element-wise activations), so a row's bits do not depend on its neighbours. What does
depend on the sequence — RoPE position, the cache write, attention over the lane's own keys —
runs per lane, on exactly the arrays and through exactly the calls the mlx-lm module makes when
that lane runs alone: same shapes, same mask argument, the same (patched, row-exact)
`scaled_dot_product_attention` looked up in the model's module at call time.

The decoder block is restated here (mlx-lm has no hook between projection and attention), so only
the architectures whose code it restates are supported: llama (SmolLM2, Mistral), qwen2, qwen3.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

# the mlx-lm modules whose `Attention` / `TransformerBlock` / `Model` this file restates
SUPPORTED_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
_BLOCK = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def supports(model: nn.Module) -> bool:
    """Whether `forward_lanes` restates `model`'s code: a supported module and the attributes it
    reads (a config variant that adds a step this file does not know falls back to solo passes)."""
    module = type(model).__module__
    inner = getattr(model, "model", None)
    if module not in SUPPORTED_MODULES or inner is None or type(inner).__module__ != module:
        return False
    if getattr(inner, "pipeline_size", 1) != 1 or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return False
    if not hasattr(model, "args") or (not model.args.tie_word_embeddings and not hasattr(model, "lm_head")):
        return False
    attention = _ATTENTION + (("q_norm", "k_norm") if module.endswith("qwen3") else ())
    for layer in inner.layers:
        if layer is None or not all(hasattr(layer, a) for a in _BLOCK):
            return False
        if not all(hasattr(layer.self_attn, a) for a in attention):
            return False
    return True


def plain_kv(layers: Sequence[Any]) -> bool:
    """Whether a cache is a stack of plain `KVCache`s (what the per-lane attention writes into)."""
    return all(type(layer) is KVCache for layer in layers)


def forward_lanes(model: nn.Module, lanes: Sequence[tuple[Sequence[int], list[Any]]]) -> list[mx.array]:
    """Logits [rows_i, vocab] (lazy, the model's dtype) of each lane (tokens, per-layer caches),
    appending each lane's rows to its caches. `supports(model)` and `plain_kv` must hold."""
    h, starts = embed_lanes(model, [tokens for tokens, _ in lanes])
    h = run_layers(model, h, starts, [caches for _, caches in lanes], range(len(model.model.layers)))
    return head_lanes(model, h, starts)


# The three pieces of a pass, apart so that pipeline stages (`engine.mlx.stages`) run a range of
# layers each on the very code one process runs: embedding, decoder layers, norm and head.


def embed_lanes(model: nn.Module, tokens: Sequence[Sequence[int]]) -> tuple[mx.array, list[int]]:
    """The embedded rows of all lanes, concatenated ([1, M, D]), and where each lane's rows start."""
    starts = list(accumulate((len(t) for t in tokens), initial=0))  # lane i's rows: starts[i]:starts[i + 1]
    ids = mx.array([[int(t) for lane in tokens for t in lane]], dtype=mx.int32)
    return model.model.embed_tokens(ids), starts


def run_layers(model: nn.Module, h: mx.array, starts: list[int], caches: Sequence[list[Any]],
               layers: range) -> mx.array:
    """Decoder layers `layers` over the lanes' rows `h` (lazy), each lane attending to its own caches.
    The masks are the module's for each lane alone, from the lane's first full-attention (and first
    sliding) layer in `layers`: every layer's cache of a lane holds the same length."""
    module = sys.modules[type(model).__module__]
    inner = model.model
    first: dict[bool, int] = {}
    for index in layers:
        first.setdefault(bool(getattr(inner.layers[index], "use_sliding", False)), index)
    masks = [_lane_masks(module, inner, h[:, starts[i] : starts[i + 1]], lane, first) for i, lane in enumerate(caches)]
    for index in layers:
        layer = inner.layers[index]
        sliding = bool(getattr(layer, "use_sliding", False))
        lane_caches = [(lane[index], masks[i][sliding]) for i, lane in enumerate(caches)]
        r = _attention(module, layer.self_attn, layer.input_layernorm(h), starts, lane_caches)
        h = h + r
        r = layer.mlp(layer.post_attention_layernorm(h))
        h = h + r
    return h


def head_lanes(model: nn.Module, h: mx.array, starts: list[int]) -> list[mx.array]:
    """The final norm and output head over all rows, cut into each lane's logits (lazy)."""
    inner = model.model
    out = inner.norm(h)
    out = inner.embed_tokens.as_linear(out) if model.args.tie_word_embeddings else model.lm_head(out)
    return [out[0, starts[i] : starts[i + 1]] for i in range(len(starts) - 1)]


def _lane_masks(module: Any, inner: nn.Module, h: mx.array, caches: list[Any], first: dict[bool, int]) -> dict[bool, Any]:
    """The mask arguments the module computes for a lane's pass alone, before any layer runs:
    full attention (the cache of the first full-attention layer) and, for llama's sliding layers,
    the windowed one."""
    create = module.create_attention_mask
    masks = {}
    if False in first:
        masks[False] = create(h, caches[first[False]])
    if True in first:
        masks[True] = create(h, caches[first[True]], window_size=inner.sliding_window)
    return masks


def _attention(module: Any, attn: nn.Module, x: mx.array, starts: list[int], lanes: list[tuple[Any, Any]]) -> mx.array:
    """`Attention.__call__` of llama / qwen2 / qwen3 with projections over all rows and the rest
    per lane (its cache and mask)."""
    queries_all, keys_all, values_all = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    sdpa = module.scaled_dot_product_attention  # at call time: the row-exact patch (kernels.attention)
    norms = hasattr(attn, "q_norm")
    outputs = []
    for i, (cache, mask) in enumerate(lanes):
        rows = slice(starts[i], starts[i + 1])
        B, L = 1, starts[i + 1] - starts[i]
        queries = queries_all[:, rows].reshape(B, L, attn.n_heads, -1)
        keys = keys_all[:, rows].reshape(B, L, attn.n_kv_heads, -1)
        values = values_all[:, rows].reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if norms:  # qwen3
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        output = sdpa(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        outputs.append(output.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return attn.o_proj(mx.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0])
