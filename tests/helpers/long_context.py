"""A tiny random model with SmolLM2's tokenizer and chat template and a 32K context, for long recorded prompts.

Coding assistants' first prompts (Codex, Claude Code: ~10-13K tokens) exceed SmolLM2-135M's 8K
context. A 2-layer random llama (SmolLM2's architecture) with SmolLM2's own tokenizer, template and
special ids renders, tokenizes, caches and resumes such a prompt exactly as SmolLM2 would, in
seconds on a CPU. Nothing is downloaded: the tokenizer files come from the converted SmolLM2 folder
(the `smollm2_folder` fixture) and the weights are deterministic random tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from tests.helpers.torch_tiny import random_weights, tiny_config

LONG_CONTEXT = 32768


def tiny_smollm2_folder(path: Path, smollm2_folder: Path, context: int = LONG_CONTEXT, seed: int = 0,
                        layers: int = 2) -> Path:
    """A `layers`-deep random llama with SmolLM2's tokenizer, chat template and special ids, `context` long."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2_folder / name).exists():
            shutil.copy(smollm2_folder / name, path / name)
    real = json.loads((smollm2_folder / "config.json").read_text())
    config = tiny_config("llama", real["vocab_size"], layers=layers)
    config.update(max_position_embeddings=context, eos_token_id=real["eos_token_id"],
                  bos_token_id=real["bos_token_id"])
    save_file({k: v.contiguous() for k, v in random_weights(config, seed).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
