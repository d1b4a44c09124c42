"""Random tiny mlx-lm models and a real (offline) byte-level BPE tokenizer, for engine tests.

Nothing here is downloaded: the tokenizer is trained in memory on a few lines of code and the
models get deterministic random weights (`mx.random.seed`) in float32. The architectures are
the real mlx-lm classes, so the engine runs their attention, MoE routing and gated DeltaNet code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from agentfold.engine.mlx.loader import LoadedModel

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "the quick brown fox jumps over the lazy dog\n",
    "if value is None:\n    raise ValueError('missing value')\n",
]


def make_tokenizer(vocab_size: int = 320):
    """A Hugging Face fast tokenizer: byte-level BPE trained on CORPUS, with an eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def _common(vocab_size: int, layers: int) -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


def tiny_config(model_type: str, vocab_size: int, layers: int | None = None) -> dict[str, Any]:
    """A small config of an mlx-lm architecture: qwen3, qwen3_moe or qwen3_next."""
    if model_type == "qwen3":
        return {"model_type": "qwen3", **_common(vocab_size, layers or 2)}
    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    }
    if model_type == "qwen3_moe":
        return {"model_type": "qwen3_moe", **_common(vocab_size, layers or 2), **moe}
    if model_type == "qwen3_next":
        # layers 0 and 2 are gated DeltaNet (ArraysCache), 1 and 3 full attention (KVCache)
        return {
            "model_type": "qwen3_next",
            **_common(vocab_size, layers or 4),
            **moe,
            "shared_expert_intermediate_size": 32,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.5,
            "full_attention_interval": 2,
        }
    raise ValueError(f"no tiny config for {model_type!r}")


def build_model(config: dict[str, Any], seed: int, logit_scale: float = 1.0) -> nn.Module:
    """The mlx-lm model of `config` with random float32 weights drawn from `seed`.

    `logit_scale` multiplies the output head, so the random model's distributions are less flat
    (greedy runs fall into loops the suffix drafter can follow, samples are not pure noise).
    """
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _to_float32(model)
    if logit_scale != 1.0:
        model.lm_head.weight = model.lm_head.weight * logit_scale
    mx.eval(model.parameters())
    model.eval()
    return model


def perturbed_copy(model: nn.Module, config: dict[str, Any], seed: int, noise: float) -> nn.Module:
    """Another instance of `config` whose weights are `model`'s plus small Gaussian noise.

    A draft model made this way agrees with the target most of the time, but not always.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    copy = model_class(args_class.from_dict(config))
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    noisy = []
    for index, (name, value) in enumerate(sorted(tree_flatten(model.parameters()))):
        shift = noise * mx.random.normal(value.shape, dtype=value.dtype, key=keys[index])
        noisy.append((name, value + shift * mx.abs(value).mean()))
    copy.load_weights(noisy, strict=True)
    mx.eval(copy.parameters())
    copy.eval()
    return copy


def loaded_model(model: nn.Module, tokenizer, config: dict[str, Any], path: Path) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer, config=dict(config), path=Path(path), dtype="float32")


def _to_float32(model: nn.Module) -> None:
    def cast(x: Any) -> Any:
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating) and x.dtype != mx.float32:
            return x.astype(mx.float32)
        return x

    model.update(tree_map(cast, model.parameters()))

