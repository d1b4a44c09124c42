"""gpt-oss (OpenAI's open-weight MoE, transformers' `modeling_gpt_oss`): the Llama-family decoder with
its differences, checked against transformers' GptOssForCausalLM.

- q / k / v / output projections carry biases, and every head has a learned sink logit that takes
  part in the softmax and adds no value (`Attention.sinks`, run by the lane attention);
- the even layers attend to their last `sliding_window` (128) keys, the odd ones to every key;
- RoPE is YaRN-scaled (`yarn_frequencies`): the low frequencies divided by `factor`, a linear ramp
  between, and cos / sin multiplied by 0.1 ln(factor) + 1;
- every feed-forward is a mixture of experts (`MoE`): a biased router whose top-k logits are
  soft-maxed among themselves (not over all experts, as Qwen's), and biased experts whose
  activation is OpenAI's clamped SwiGLU, (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g) with
  g = min(gate, 7).

The experts run on the GGUF's blocks (MXFP4 in OpenAI's files: `moe_blocks.BlockExperts` with their
biases and `swiglu`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.llama import DecoderLayer, Linear, ModelArgs, Rope, Transformer
from agentfold.engine.torch.models.qwen3_moe import MoEBlock


def yarn_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (float64 [head_dim / 2]) and cos / sin factor, as transformers'
    `_compute_yarn_parameters` defines them (its `truncate` flag included)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32.0), float(scaling.get("beta_slow") or 1.0)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    extrapolated = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency as trained (high frequencies), 0: divided by `factor`
    inv_freq = extrapolated / factor * (1 - keep) + extrapolated * keep
    attention_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, float(attention_factor)


class MoE(MoEBlock):
    """gpt-oss's feed-forward: a biased router, softmax over each row's top-k logits, and experts
    that `moe_blocks.attach_block` installs (with their biases and OpenAI's SwiGLU)."""

    def __init__(self, config: dict[str, Any], args: ModelArgs, layer_index: int) -> None:
        super().__init__(config, args, layer_index)
        self.gate = Linear(args.hidden_size, int(config["num_experts"]), bias=True)
        self.swiglu_limit = float(config.get("swiglu_limit", 7.0))
        self.swiglu_alpha = float(config.get("swiglu_alpha", 1.702))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [n, k] (by logit, highest first) and their gates, the softmax of
        those k logits (float32), row by row."""
        values, ids = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
        return ids, ops.softmax(values)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """OpenAI's clamped SwiGLU of an expert's gate and up rows; elementwise, so each row's bits are
    its own (the sigmoid through `ops.sigmoid`, row by row where torch's vector loop would mix rows)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * ops.sigmoid(gate * alpha))


class GptOss(Transformer):
    """gpt-oss's text model: biased attention with sinks, alternating sliding windows, YaRN."""

    def __init__(self, args: ModelArgs, config: dict[str, Any]) -> None:
        layers = []
        types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                              for i in range(args.num_hidden_layers)]
        if len(types) != args.num_hidden_layers:
            raise ValueError(f"layer_types names {len(types)} layers, the model has {args.num_hidden_layers}")
        for i, kind in enumerate(types):
            layer = DecoderLayer(args, MoE(config, args, i))
            layer.self_attn.sinks = nn.Parameter(torch.zeros(args.num_attention_heads), requires_grad=False)
            layer.self_attn.window = int(config["sliding_window"]) if kind == "sliding_attention" else None
            layers.append(layer)
        super().__init__(args, layers)
        scaling = config.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) == "yarn":
            inv_freq, attention_factor = yarn_frequencies(args.head_dim, args.rope_theta, scaling)
            self.rope = Rope(args.head_dim, args.rope_theta, inv_freq=inv_freq, attention_factor=attention_factor)


def build(config: dict[str, Any]) -> GptOss:
    """A gpt-oss model (model_type gpt_oss) with uninitialized weights."""
    plain = {key: value for key, value in config.items() if key not in ("rope_scaling", "rope_parameters")}
    experts = int(config.get("num_local_experts") or config["num_experts"])
    moe = {**config, "num_experts": experts, "moe_intermediate_size": int(config["intermediate_size"])}
    args = ModelArgs.from_config({**plain, "attention_bias": config.get("attention_bias", True)})
    return GptOss(args, moe)
