"""A GGUF file as a Hugging Face checkpoint: config, tensors under HF names, tokenizer (numpy only).

llama.cpp writes Hugging Face checkpoints into GGUF under its own tensor names, permutes the q/k
projections of llama-family models for its RoPE layout, adds 1 to Gemma's norm weights and keeps
the tokenizer as metadata. This module undoes each of those, so the result loads into the stock
model classes of either backend and behaves like the original checkpoint. Values come from
`gguf_file.GGUFFile.values` (the gguf package's reference dequantization), one tensor at a time,
so a loader can convert each weight before the next is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentfold.engine.gguf_file import GGUFError, GGUFFile

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss")
LOADER_VERSION = 2  # bump when the weights a file loads to change (snapshot and weight-cache keys); 2: reference dequantization

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
# Qwen3-MoE (llama.cpp's `qwen3moe`): every layer routes to experts. The router is `ffn_gate_inp`
# [experts, hidden]; each `ffn_*_exps` tensor holds all experts of a projection, [experts, rows, cols]
# in numpy order (ggml's {cols, rows, experts}), expert e's rows contiguous. They keep that stacked
# form under mlx-lm's `switch_mlp` names, which the torch loader stacks per-expert checkpoints into.
_QWEN3MOE_LAYER_NAMES = {
    **{part: name for part, name in _LAYER_NAMES.items() if not part.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# gpt-oss (llama.cpp's `gpt-oss`): biased q / k / v / output, a sink logit per head (`attn_sinks`,
# transformers' bare `self_attn.sinks` parameter), the feed-forward's norm under gemma's name
# (`post_attention_norm`), a biased router and biased experts stored as Qwen3-MoE's are.
_GPTOSS_LAYER_NAMES = {
    **{part: name for part, name in _QWEN3MOE_LAYER_NAMES.items() if part not in ("attn_q_norm", "attn_k_norm",
                                                                                  "ffn_norm")},
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
}
_LAYER_TABLES = {"gemma3": _GEMMA_LAYER_NAMES, "qwen3moe": _QWEN3MOE_LAYER_NAMES, "gpt-oss": _GPTOSS_LAYER_NAMES}
_BARE_PARAMETERS = ("self_attn.sinks",)  # parameters of a module, not modules with a weight: no suffix
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# End-of-generation tokens as llama.cpp marks them (llama-vocab.cpp): a reply ends at any of them
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
              "<|end|>", "<|return|>", "<|call|>", "<EOT>", "<|EOT|>")


@dataclass
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms; tensors are read on demand (`tensor`, `tensors`)."""

    file: GGUFFile
    architecture: str
    config: dict[str, Any]
    names: dict[str, str]  # HF name -> GGUF tensor name, in file order
    metadata: dict[str, Any] = field(repr=False, default_factory=dict)

    def tensor(self, hf_name: str) -> np.ndarray:
        """The weight under its HF name, float32, with llama.cpp's changes undone."""
        value = self.rows_in_hf_order(hf_name, self.file.values(self.names[hf_name]))
        if self.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            value = value - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) norm weights
        return value

    def rows_in_hf_order(self, hf_name: str, rows: np.ndarray) -> np.ndarray:
        """`rows` (the weight's values, or anything with one row per output channel, such as its
        blocks) in Hugging Face's row order: llama.cpp permutes llama's q / k rows for its RoPE."""
        if self.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = self.config["num_attention_heads"] if ".q_proj." in hf_name else self.config["num_key_value_heads"]
            return unpermute(rows, heads)
        return rows

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every weight under its HF name, one at a time (a loader can convert each before the next)."""
        for hf_name in self.names:
            yield hf_name, self.tensor(hf_name)

    def source_type(self, hf_name: str) -> str:
        """The GGUF block type a weight is stored in (Q4_K, F32, ...)."""
        return self.file.tensors[self.names[hf_name]].type_name


def scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


def config_from_metadata(meta: dict[str, Any], arch: str, has_output: bool) -> dict[str, Any]:
    """A Hugging Face config.json for the architecture, from the GGUF's `<arch>.*` keys."""
    def get(key: str, default: Any = None) -> Any:
        return scalar(meta, f"{arch}.{key}", default)

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    feed_forward = get("feed_forward_length", 0 if arch in ("qwen3moe", "gpt-oss") else None)  # (unused by all-MoE layers)
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(feed_forward),
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
    if arch == "qwen3moe":
        config.update(moe_config(meta, arch, config))
    if arch == "gpt-oss":
        config.update(gpt_oss_config(meta, arch, config))
    eos = scalar(meta, "tokenizer.ggml.eos_token_id")
    eog = end_of_generation_ids(meta)
    if eos is not None:
        config["eos_token_id"] = [int(eos), *(i for i in eog if i != int(eos))] if eog else int(eos)
    bos = scalar(meta, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    return config


def moe_config(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's keys of a Hugging Face config, as llama.cpp's qwen3moe graph runs it: every layer
    sparse (llama.cpp has no dense layers for it), a softmax router whose top-k gates are renormalized
    (`norm_topk_prob`: llama.cpp's build_moe_ffn is called with norm_w true), and the experts' width
    from `expert_feed_forward_length`, or feed_forward_length / expert_used_count where a file lacks it
    (llama.cpp's fallback)."""
    def get(key: str) -> Any:
        return scalar(meta, f"{arch}.{key}")

    experts, used = get("expert_count"), get("expert_used_count")
    if not experts or not used:
        raise GGUFError(f"{arch}: expert_count and expert_used_count must be set (got {experts}, {used})")
    width = get("expert_feed_forward_length") or config["intermediate_size"] // int(used)
    if not width:
        raise GGUFError(f"{arch}: no expert_feed_forward_length (nor a feed_forward_length to derive it from)")
    return {"model_type": "qwen3_moe", "num_experts": int(experts), "num_experts_per_tok": int(used),
            "moe_intermediate_size": int(width), "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "hidden_act": "silu", "head_dim": _head_dim(config)}


def gpt_oss_config(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's keys of a Hugging Face config (transformers' GptOssConfig), from llama.cpp's: every
    layer routes to `expert_count` experts of width `expert_feed_forward_length`, the even layers
    attend to their last `attention.sliding_window` keys, and RoPE is YaRN-scaled. Two numbers the
    file does not carry are the model's own constants, as llama.cpp hard-codes them: the SwiGLU
    clamp 7.0 and slope 1.702. YaRN's beta_fast / beta_slow are the paper's 32 / 1 (neither
    llama.cpp's converter nor OpenAI's checkpoint sets others); the correction range is not rounded
    to whole dimensions (`truncate`: false, OpenAI's reference and transformers; llama.cpp rounds
    it, which moves a few of the 32 frequencies by up to one ramp step)."""
    def get(key: str, default: Any = None) -> Any:
        return scalar(meta, f"{arch}.{key}", default)

    experts, used, width = get("expert_count"), get("expert_used_count"), get("expert_feed_forward_length")
    if not experts or not used or not width:
        raise GGUFError(f"{arch}: expert_count, expert_used_count and expert_feed_forward_length must be set "
                        f"(got {experts}, {used}, {width})")
    layers = config["num_hidden_layers"]
    rope: dict[str, Any] = {"rope_type": "default"}
    if str(get("rope.scaling.type", "none")) == "yarn":
        rope = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")), "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 4096))}
    return {"model_type": "gpt_oss", "num_local_experts": int(experts), "num_experts_per_tok": int(used),
            "intermediate_size": int(width), "sliding_window": int(get("attention.sliding_window", 128)),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "rope_scaling": rope, "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
            "head_dim": _head_dim(config)}


def _head_dim(config: dict[str, Any]) -> int:
    """A head's width: the file's `attention.key_length`, else hidden / heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """Control tokens that end a reply besides the declared eos, as llama.cpp marks them (its
    `<|im_end|>` / `<|endoftext|>` / `<end_of_turn>` ... list): Qwen2.5 declares `<|im_end|>` but
    also ends replies with `<|endoftext|>`, which a decoder must not read past."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    kinds = meta.get("tokenizer.ggml.token_type")
    found = []
    for text in _EOG_TEXTS:
        if text == "<|end|>" and _is_harmony(tokens):
            continue
        try:
            index = tokens.index(text)
        except ValueError:
            continue
        if kinds is None or int(kinds[index]) in (3, 4):  # CONTROL or USER_DEFINED, never a normal word
            found.append(index)
    return found


# The harmony format's markers (gpt-oss): a reply holds several messages, each `<|channel|>NAME
# <|message|>TEXT<|end|>` after `<|start|>assistant`, and ends only at `<|return|>` or `<|call|>`.
# llama.cpp takes `<|end|>` off its end-of-generation list for such a vocabulary and renders these
# markers into the text, where the harmony parser (`chat.harmony`) reads the channels.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


def _is_harmony(tokens: list[str]) -> bool:
    return all(text in tokens for text in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>"))


def unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (it interleaves the RoPE halves per head)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return np.ascontiguousarray(np.swapaxes(w, 1, 2).reshape(rows, *rest))


def hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None: not a tensor of these architectures)."""
    base, _, suffix = name.rpartition(".")  # suffix: weight | bias
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", base)
    if match:
        table = _LAYER_TABLES.get(arch, _LAYER_NAMES)
        part = table.get(match.group(2))
        if part is None:
            return None
        if part in _BARE_PARAMETERS:
            return f"model.layers.{match.group(1)}.{part}"
        return f"model.layers.{match.group(1)}.{part}.{suffix}"
    top = _TOP_NAMES.get(base)
    return f"{top}.{suffix}" if top else None


def open_gguf(path: str | Path) -> GGUFModel:
    """Open `path` (header and tensor table only; nothing dequantized yet). Raises GGUFError with
    one line for a file it cannot load: not GGUF, an architecture or tensor type it cannot read."""
    file = GGUFFile(path)
    meta = file.metadata
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    file.check_readable()
    names: dict[str, str] = {}
    for name in file.tensors:
        new = hf_name(name, arch)
        if new is None:
            raise GGUFError(f"unexpected tensor {name!r} for architecture {arch}")
        names[new] = name
    has_output = any(k.startswith("output.") for k in file.tensors)
    config = config_from_metadata(meta, arch, has_output)
    return GGUFModel(file, arch, config, names, meta)


def build_tokenizer(meta: dict[str, Any], arch: str, backend: Any = None) -> Any:
    """A fast Hugging Face tokenizer rebuilt from GGUF metadata, chat template included. `backend`:
    the `tokenizers.Tokenizer` this metadata converts to, when already known (converting a 151K
    vocabulary takes ~2 s, and importing transformers' GGUF mapping ~0.8 s; the weight cache keeps
    the result)."""
    from transformers import PreTrainedTokenizerFast

    if backend is None:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        fields = {name: to_python(meta[f"tokenizer.{key}"])
                  for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in meta}
        if _is_harmony(fields.get("tokens") or []) and fields.get("token_type"):
            # harmony's markers as user-defined tokens (4): kept whole, and kept in decoded text
            fields["token_type"] = [4 if token in HARMONY_MARKERS else kind
                                    for token, kind in zip(fields["tokens"], fields["token_type"], strict=True)]
        backend, _ = convert_gguf_tokenizer(arch, fields)
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = scalar(meta, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    add_bos = scalar(meta, "tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=to_python(meta.get("tokenizer.chat_template")) or BUILTIN_TEMPLATES.get(arch),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=bool(add_bos),
    )


# Chat templates for files that carry none, by architecture, as llama.cpp falls back to its built-in
# ones (the shipped Gemma 3 270M GGUF has no `tokenizer.chat_template`; without this its prompts
# were rendered as ChatML, a format Gemma was never trained on). Gemma 3's instruction template:
# turns of `<start_of_turn>user|model ... <end_of_turn>`, a system message prefixed to the first
# user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
BUILTIN_TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}


def to_python(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
