"""Random tiny Hugging Face folders (config.json + safetensors + tokenizer) for the torch backend.

Nothing is downloaded: the tokenizer is `tiny_models.make_tokenizer` (byte-level BPE trained in
memory) saved with `save_pretrained`, and the weights are deterministic random float32 tensors
under Hugging Face's names, so the folders load through the same code as real checkpoints (and
through mlx-lm, which serves as an independent reference implementation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.helpers.tiny_models import make_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
# a prompt the suffix drafter can copy from, and a ChatML template for the tiny tokenizer
TINY_PROMPT = "def add(a, b):\n    return a + b\n" * 3 + "def add(a, b):\n    return"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_config(model_type: str, vocab_size: int, layers: int = 2) -> dict[str, Any]:
    """A small config: llama / qwen3 dense, qwen3_moe (routed), qwen2_moe (routed + shared expert)."""
    config: dict[str, Any] = {
        "model_type": model_type, "architectures": ["TinyForCausalLM"], "hidden_size": HIDDEN,
        "num_hidden_layers": layers, "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    if model_type in ("qwen3_moe", "qwen2_moe"):
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[layers - 1] if layers > 1 else [])
    if model_type == "qwen2_moe":
        config.update(shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[])  # as mlx-lm
    return config


def random_weights(config: dict[str, Any], seed: int, logit_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 weights; `logit_scale` sharpens the output head (greedy loops)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    h, vocab = config["hidden_size"], config["vocab_size"]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {"model.embed_tokens.weight": rand(vocab, h, scale=1.0), "model.norm.weight": 1 + rand(h),
         "lm_head.weight": rand(vocab, h, scale=logit_scale / h**0.5)}
    moe = config["model_type"] in ("qwen3_moe", "qwen2_moe")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
                  p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                  p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q)})
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            w.update({p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM), p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM)})
        if config["model_type"] == "qwen2_moe":
            w.update({p + f"self_attn.{n}_proj.bias": rand(size) for n, size in (("q", q), ("k", kv), ("v", kv))})
        if moe and i not in config["mlp_only_layers"]:
            inner = config["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = rand(config["num_experts"], h, scale=0.5)
            for e in range(config["num_experts"]):
                w.update(_mlp(p + f"mlp.experts.{e}.", h, inner, rand))
            if config.get("shared_expert_intermediate_size"):
                w.update(_mlp(p + "mlp.shared_expert.", h, config["shared_expert_intermediate_size"], rand))
                w[p + "mlp.shared_expert_gate.weight"] = rand(1, h)
        else:
            w.update(_mlp(p + "mlp.", h, config["intermediate_size"], rand))
    return w


def _mlp(prefix: str, hidden: int, inner: int, rand) -> dict[str, torch.Tensor]:
    return {prefix + "gate_proj.weight": rand(inner, hidden), prefix + "up_proj.weight": rand(inner, hidden),
            prefix + "down_proj.weight": rand(hidden, inner)}


def write_folder(path: Path, model_type: str, seed: int = 0, layers: int = 2, noise: float = 0.0,
                 noise_seed: int = 1) -> Path:
    """A loadable tiny checkpoint folder at `path`; `noise` perturbs the weights (a draft model)."""
    tokenizer = make_tokenizer()
    config = tiny_config(model_type, len(tokenizer), layers)
    config["eos_token_id"] = tokenizer.eos_token_id
    weights = random_weights(config, seed)
    if noise:
        g = torch.Generator().manual_seed(noise_seed)
        weights = {k: v + noise * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(path))
    return path


def gemma3_config(vocab_size: int, layers: int = 3, window: int = 8, all_sliding: bool = False) -> dict[str, Any]:
    """A tiny Gemma 3 text config: every third layer global (or none), a `window`-key sliding window,
    and a query scale that is not head_dim ** -0.5 (so a model that ignores it shows)."""
    config = tiny_config("gemma3_text", vocab_size, layers)
    config.update(architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True, query_pre_attn_scalar=32,
                  sliding_window=window, sliding_window_pattern=3, rope_theta=1_000_000.0,
                  rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh")
    if all_sliding:
        config["layer_types"] = ["sliding_attention"] * layers
    return config


def write_gemma3_folder(path: Path, seed: int = 0, layers: int = 3, window: int = 8,
                        all_sliding: bool = False) -> Path:
    """A loadable tiny Gemma 3 folder (tied head, Gemma's four norms per layer, q / k norms)."""
    tokenizer = make_tokenizer()
    config = gemma3_config(len(tokenizer), layers, window, all_sliding)
    config["eos_token_id"] = tokenizer.eos_token_id
    weights = random_weights({**config, "model_type": "qwen3"}, seed)  # Llama names plus q / k norms
    del weights["lm_head.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(layers):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = torch.randn(HIDDEN, generator=g) * 0.08
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(path))
    return path
