"""Gemma 3 (text decoder): the Llama-family pieces with Gemma's differences, checked against
transformers' `modeling_gemma3` and mlx-lm's `gemma3_text`.

- RMSNorm scales by (1 + weight), in float32 (the weights here follow Hugging Face; llama.cpp's
  GGUF stores 1 + weight and `engine.mlx.gguf` subtracts the 1 when it reads one);
- q and k are RMS-normalized per head, and queries are scaled by query_pre_attn_scalar ** -0.5;
- each layer norms its attention and feed-forward outputs too (pre- and post- norms);
- the feed-forward is gated GELU (tanh approximation);
- the embedding is multiplied by sqrt(hidden) rounded to the embedding's dtype, and the output
  head is tied to the unscaled embedding;
- local layers attend to their last `sliding_window` keys with RoPE base 10,000, global layers
  (every `sliding_window_pattern`-th, or as `layer_types` says) to all keys with RoPE base
  `rope_theta` (1,000,000) and the optional linear `rope_scaling` of the larger models.

The cache keeps every key of every layer (the window is a mask, not a ring buffer), so rollback,
truncation and snapshots stay the llama ones: lowering a length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.llama import MLP, Attention, LayerLanes, ModelArgs, RMSNorm, Rope, Transformer

LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0  # transformers' Gemma3TextConfig defaults


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in float32, as Hugging Face's Gemma3RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, add_one=True)


@dataclass
class Layout:
    """Which layers slide, how far, and each kind's RoPE, from a Gemma 3 config."""

    sliding: list[bool]
    window: int
    local_theta: float
    global_theta: float
    global_factor: float  # linear RoPE scaling of the global layers (1: none)
    query_scale: float

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Layout:
        layers = int(config["num_hidden_layers"])
        types = config.get("layer_types")
        if types:
            sliding = [kind == "sliding_attention" for kind in types]
        else:
            pattern = int(config.get("sliding_window_pattern", 6))
            sliding = [bool((i + 1) % pattern) for i in range(layers)]
        if len(sliding) != layers:
            raise ValueError(f"layer_types names {len(sliding)} layers, the model has {layers}")
        parameters = config.get("rope_parameters") or {}
        local = parameters.get("sliding_attention") or {}
        full = {**(config.get("rope_scaling") or {}), **(parameters.get("full_attention") or {})}
        kind = full.get("rope_type", full.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported by the torch backend")
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
        return cls(
            sliding=sliding,
            window=int(config.get("sliding_window") or 4096),
            local_theta=float(local.get("rope_theta", config.get("rope_local_base_freq", LOCAL_THETA))),
            global_theta=float(full.get("rope_theta", config.get("rope_theta", GLOBAL_THETA))),
            global_factor=float(full.get("factor", 1.0)) if kind == "linear" else 1.0,
            query_scale=float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        )


class DecoderLayer(nn.Module):
    """Gemma's block: both sublayers' outputs are normed before they join the residual stream."""

    def __init__(self, args: ModelArgs, layout: Layout, index: int) -> None:
        super().__init__()
        self.sliding = layout.sliding[index]
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(args, norm=GemmaRMSNorm)
        self.self_attn.scale = layout.query_scale
        self.self_attn.window = layout.window if self.sliding else None
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, args.intermediate_size, gated=ops.gelu_tanh_mul)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, lanes: LayerLanes, rope: Rope) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), lanes, rope)
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3(Transformer):
    """Gemma 3's text model: `Transformer` with Gemma layers, norms, embedding scale and two RoPEs."""

    norm_class = GemmaRMSNorm

    def __init__(self, args: ModelArgs, layout: Layout) -> None:
        super().__init__(args, [DecoderLayer(args, layout, i) for i in range(args.num_hidden_layers)])
        self.layout = layout
        self.rope = Rope(args.head_dim, layout.global_theta, layout.global_factor)
        self.local_rope = Rope(args.head_dim, layout.local_theta)
        self.register_buffer("embed_scale", torch.tensor(args.hidden_size**0.5), persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().embed(tokens)
        return h * self.embed_scale.to(h.dtype)  # sqrt(hidden) in the embedding's dtype, as transformers

    def rope_for(self, layer: nn.Module) -> Rope:
        return self.local_rope if layer.sliding else self.rope


def build(config: dict[str, Any]) -> Gemma3:
    """A Gemma 3 text model (model_type gemma3_text) with uninitialized weights."""
    layout = Layout.from_config(config)
    plain = {key: value for key, value in config.items() if key != "rope_scaling"}  # read by `Layout`
    args = ModelArgs.from_config({**plain, "tie_word_embeddings": config.get("tie_word_embeddings", True)})
    args.qk_norm = True
    return Gemma3(args, layout)
