"""GGUF files written by the gguf package itself, for the loader's tests.

`block_bytes` makes a tensor of any ggml type: quantized by the gguf package where it can
quantize that type, else random blocks (any bytes are valid blocks; the high byte of every
16-bit word has its top exponent bit cleared, so every float16 scale is finite). `write_tiny_model`
writes a small model of a real architecture (llama, qwen2, gemma3) whose linear weights are one
ggml type, with SmolLM2's tokenizer metadata, as llama.cpp's converter lays it out: q / k rows
permuted for llama (`llamacpp_permute`, written here from convert_hf_to_gguf.py's definition, not
from our loader), Gemma's norms stored as 1 + w. `write_tiny_qwen3moe` writes a Qwen3-MoE with
mixed types and its experts as 3-D tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf import constants as gguf_constants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from agentfold.bench.moe_files import add_field as _add_field

PLAIN = {"F32": np.float32, "F16": np.float16}


def can_quantize(kind: str) -> bool:
    from gguf import quants

    traits = getattr(quants, "_type_traits", {}).get(GGMLQuantizationType[kind])
    return traits is not None and "quantize_blocks" in traits.__dict__


def block_bytes(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """A [rows, cols] tensor of ggml type `kind` as stored: float arrays for F32 / F16, else uint8 blocks."""
    if kind in PLAIN:
        return (rng.standard_normal((rows, cols)) * scale).astype(PLAIN[kind])
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    if can_quantize(kind):
        return quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), qtype)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    raw[:, 1::2] &= 0xBF  # float16 fields: exponent below 31, so finite
    blocks = raw.reshape(rows, -1, size)
    for offset, scale_of_one in K_SCALES.get(kind, ()):  # the super-block scales: weights near `scale`
        blocks[:, :, offset : offset + 2] = np.float16(scale * scale_of_one).reshape(1).view(np.uint8)
    return raw


# The float16 super-block scales (d, dmin) of the K-quants the gguf package cannot quantize, by byte
# offset in the block, as a factor of the weights' typical size: random integers under random
# scales made weights in the thousands and models whose logits any rounding overturns.
K_SCALES = {
    "Q2_K": [(80, 1 / 16), (82, 1 / 32)],
    "Q3_K": [(108, 1 / 64)],
    "Q4_K": [(0, 1 / 256), (2, 1 / 128)],
    "Q5_K": [(0, 1 / 512), (2, 1 / 128)],
    "Q6_K": [(208, 1 / 1024)],
}


def reference(reader: GGUFReader, name: str) -> np.ndarray:
    """The gguf package's own values for a tensor: its reader's view, its dequantization."""
    tensor = next(t for t in reader.tensors if t.name == name)
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q / k row order for llama (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def add(writer: GGUFWriter, name: str, data: np.ndarray, kind: str) -> None:
    if kind in PLAIN:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])


def tokenizer_fields(source: Path) -> dict[str, Any]:
    """Every tokenizer.* key of a real GGUF (SmolLM2's), to write into a tiny model."""
    reader = GGUFReader(str(source))
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def tiny_tokenizer_fields() -> dict[str, Any]:
    """A 320-token byte-level BPE (tests.helpers.tiny_models) as GGUF tokenizer keys (gpt2 model):
    tiny models load in a fraction of the time SmolLM2's 49K vocabulary takes."""
    import json

    from tests.helpers.tiny_models import SPECIAL_TOKENS, make_tokenizer

    data = json.loads(make_tokenizer().backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": tokens.index(SPECIAL_TOKENS[0]),
            "tokenizer.ggml.bos_token_id": tokens.index(SPECIAL_TOKENS[1])}


def write_tiny_model(path: Path, arch: str, kind: str, tokenizer: dict[str, Any], seed: int = 0,
                     hidden: int = 256, inner: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> Path:
    """A small `arch` model whose linear weights are ggml type `kind` (embedding and norms float)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    head_dim = hidden // heads
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(64)
    for key, value in tokenizer.items():
        _add_field(writer, key, value)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    add(writer, "token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float16), "F16")

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    add(writer, "output_norm.weight", norm(hidden), "F32")
    for i in range(layers):
        shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
                  "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
                  "ffn_gate": (inner, hidden), "ffn_up": (inner, hidden), "ffn_down": (hidden, inner)}
        for part, (rows, cols) in shapes.items():
            add(writer, f"blk.{i}.{part}.weight", block_bytes(kind, rows, cols, rng), kind)
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm"]
                                            if arch == "gemma3" else [])
        for part in norms:
            add(writer, f"blk.{i}.{part}.weight", norm(head_dim if part.endswith(("q_norm", "k_norm")) else hidden),
                "F32")
        if arch == "qwen2":
            for part, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                add(writer, f"blk.{i}.{part}.bias", (rng.standard_normal(rows) * 0.02).astype(np.float32), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The ggml types of a tiny qwen3moe file's weights, per layer where they vary: the experts of one
# layer mix three types (gate and up, which run as one GEMM, differ), as llama.cpp's Q4_K_M mixes
# Q4_K and Q6_K. Attention's output projection reads heads * head_dim = 128 values a row: Q8_0.
QWEN3MOE_TYPES = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                  "attn_output": "Q8_0", "ffn_gate_inp": "F32"}
QWEN3MOE_EXPERT_TYPES = [{"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q6_K", "ffn_down_exps": "Q8_0"},
                         {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}]


def write_tiny_qwen3moe(path: Path, tokenizer: dict[str, Any], seed: int = 0, hidden: int = 256, layers: int = 2,
                        heads: int = 4, kv_heads: int = 2, head_dim: int = 32, experts: int = 8, used: int = 2,
                        expert_inner: int = 256, router_scale: float = 0.5,
                        expert_types: list[dict[str, str]] | None = None) -> Path:
    """A small Qwen3-MoE as llama.cpp's converter lays it out (gguf-py's `qwen3moe` tensors and keys):
    per layer q / k / v / output, q / k norms [head_dim], the router `ffn_gate_inp` [experts, hidden]
    in F32 (llama.cpp never quantizes it), and each projection's experts as one 3-D tensor
    `ffn_{gate,up,down}_exps` [experts, rows, cols] (numpy order). head_dim is set apart from
    hidden / heads (key_length), as in Qwen3-30B-A3B. `router_scale`: the router's weights, large
    enough that tokens spread over the experts with clear winners. `expert_types`: the experts'
    types per layer (cycled; default QWEN3MOE_EXPERT_TYPES)."""
    expert_types = expert_types or QWEN3MOE_EXPERT_TYPES
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(3 * expert_inner)  # the checkpoint's dense width: no layer uses it
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    writer.add_expert_feed_forward_length(expert_inner)
    for key, value in tokenizer.items():
        _add_field(writer, key, value)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    def weight(name: str, part: str, rows: int, cols: int, scale: float = 0.05) -> None:
        kind = QWEN3MOE_TYPES[part]
        add(writer, name, block_bytes(kind, rows, cols, rng, scale), kind)

    weight("token_embd.weight", "token_embd", vocab, hidden, 0.5)
    for i in range(layers):
        add(writer, f"blk.{i}.attn_norm.weight", norm(hidden), "F32")
        for part, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim)):
            weight(f"blk.{i}.{part}.weight", part, rows, cols)
        add(writer, f"blk.{i}.attn_q_norm.weight", norm(head_dim), "F32")
        add(writer, f"blk.{i}.attn_k_norm.weight", norm(head_dim), "F32")
        add(writer, f"blk.{i}.ffn_norm.weight", norm(hidden), "F32")
        weight(f"blk.{i}.ffn_gate_inp.weight", "ffn_gate_inp", experts, hidden, router_scale)
        for part, (rows, cols) in (("ffn_gate_exps", (expert_inner, hidden)), ("ffn_up_exps", (expert_inner, hidden)),
                                   ("ffn_down_exps", (hidden, expert_inner))):
            kind = expert_types[i % len(expert_types)][part]
            data = block_bytes(kind, experts * rows, cols, rng)
            add(writer, f"blk.{i}.{part}.weight", data.reshape(experts, rows, -1), kind)
    add(writer, "output_norm.weight", norm(hidden), "F32")
    weight("output.weight", "output", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The ggml types of a tiny gpt-oss file, as OpenAI's own GGUF (ggml-org/gpt-oss-20b-GGUF) stores them:
# experts in MXFP4, attention, embedding and head in Q8_0, router, norms, biases and sinks in F32.
# Layer 1's attention is Q4_0 / Q5_0 instead, to run a second block type beside MXFP4.
GPT_OSS_TYPES = [{"attn": "Q8_0"}, {"attn": "Q4_0", "attn_output": "Q5_0"}]
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def harmony_tokenizer_fields(chat_template: str | None = None) -> dict[str, Any]:
    """`tiny_tokenizer_fields` with harmony's control tokens (gpt-oss's chat format) appended and
    `<|return|>` as the end of a reply, as gpt-oss's GGUF declares it; `chat_template`: the
    file's template (gpt-oss's own: tests/fixtures/harmony/openai-gpt-oss-120b.jinja)."""
    fields = tiny_tokenizer_fields()
    tokens = list(fields["tokenizer.ggml.tokens"]) + HARMONY_TOKENS
    fields = {**fields, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": list(fields["tokenizer.ggml.token_type"]) + [3] * len(HARMONY_TOKENS),
              "tokenizer.ggml.eos_token_id": tokens.index("<|return|>")}
    if chat_template is not None:
        fields["tokenizer.chat_template"] = chat_template
    return fields


def write_tiny_gpt_oss(path: Path, tokenizer: dict[str, Any], seed: int = 0, hidden: int = 192, layers: int = 2,
                       heads: int = 4, kv_heads: int = 2, head_dim: int = 64, experts: int = 8, used: int = 4,
                       expert_inner: int = 160, window: int = 8, router_scale: float = 0.5) -> Path:
    """A small gpt-oss as llama.cpp's converter lays it out (gguf-py's `gpt-oss` tensors and keys):
    biased q / k / v / output, `attn_sinks` [heads], `post_attention_norm`, a biased F32 router
    `ffn_gate_inp`, and biased experts `ffn_{gate,up,down}_exps` as 3-D MXFP4 tensors (gate and up
    split apart, as the converter splits OpenAI's interleaved gate_up); YaRN keys as OpenAI's
    (factor 32 over an original 4096), and a short sliding `window` so the even layers' windows
    bind on a short prompt (OpenAI's is 128). head_dim is 64, OpenAI's."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(expert_inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(150000.0)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(used)
    writer.add_expert_feed_forward_length(expert_inner)
    writer.add_sliding_window(window)
    writer.add_rope_scaling_type(gguf_constants.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    for key, value in tokenizer.items():
        _add_field(writer, key, value)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    def floats(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    add(writer, "token_embd.weight", block_bytes("Q8_0", vocab, hidden, rng, 0.5), "Q8_0")
    for i in range(layers):
        kinds = GPT_OSS_TYPES[i % len(GPT_OSS_TYPES)]
        add(writer, f"blk.{i}.attn_norm.weight", norm(hidden), "F32")
        for part, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim)):
            kind = kinds.get(part, kinds["attn"])
            add(writer, f"blk.{i}.{part}.weight", block_bytes(kind, rows, cols, rng), kind)
            add(writer, f"blk.{i}.{part}.bias", floats(rows), "F32")
        add(writer, f"blk.{i}.attn_sinks.weight", floats(heads, scale=1.0), "F32")
        add(writer, f"blk.{i}.post_attention_norm.weight", norm(hidden), "F32")
        add(writer, f"blk.{i}.ffn_gate_inp.weight", floats(experts, hidden, scale=router_scale), "F32")
        add(writer, f"blk.{i}.ffn_gate_inp.bias", floats(experts, scale=0.1), "F32")
        for part, (rows, cols) in (("ffn_gate_exps", (expert_inner, hidden)), ("ffn_up_exps", (expert_inner, hidden)),
                                   ("ffn_down_exps", (hidden, expert_inner))):
            data = block_bytes("MXFP4", experts * rows, cols, rng)
            add(writer, f"blk.{i}.{part}.weight", data.reshape(experts, rows, -1), "MXFP4")
            add(writer, f"blk.{i}.{part}.bias", floats(experts, rows), "F32")
    add(writer, "output_norm.weight", norm(hidden), "F32")
    add(writer, "output.weight", block_bytes("Q8_0", vocab, hidden, rng), "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
