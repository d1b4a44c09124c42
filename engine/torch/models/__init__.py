"""PyTorch model implementations for the torch backend, one file per family."""

from __future__ import annotations

from typing import Any

from torch import nn

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma3_text", "gpt_oss")


def build(config: dict[str, Any]) -> nn.Module:
    """An uninitialized model for a Hugging Face config dict (ValueError if unsupported)."""
    model_type = config.get("model_type")
    if model_type in ("qwen3_moe", "qwen2_moe"):
        from agentfold.engine.torch.models import qwen3_moe
        return qwen3_moe.build(config)
    if model_type == "gpt_oss":
        from agentfold.engine.torch.models import gpt_oss

        return gpt_oss.build(config)
    if model_type == "gemma3_text":
        from agentfold.engine.torch.models import gemma3

        return gemma3.build(config)
    if model_type in ("llama", "qwen2", "qwen3"):
        from agentfold.engine.torch.models.llama import ModelArgs, Transformer

        return Transformer(ModelArgs.from_config(config))
    raise ValueError(f"model_type {model_type!r} is not supported by the torch backend "
                     f"(supported: {', '.join(MODEL_TYPES)})")
