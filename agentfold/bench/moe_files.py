"""The random GGUF files `agentfold bench moe` runs: the agent MoE models at their real dimensions
in the block types their published files use, written once and reused.

**The file.** `SHAPES` holds each model's numbers; where they come from:

- `qwen3-coder-30b-a3b`: Qwen/Qwen3-Coder-30B-A3B-Instruct's config.json (48 layers, hidden 2048, 32
  query / 4 key-value heads of head_dim 128, 128 experts of which 8 are used, moe_intermediate_size
  768, intermediate_size 6144, vocab_size 151936, max_position_embeddings 262144, rope_theta 1e7,
  rms_norm_eps 1e-6). Block types: llama.cpp's Q4_K_M mix as `llama-quantize` makes it
  (src/llama-quant.cpp): Q4_K by default, output Q6_K, and attn_v and ffn_down(_exps) Q6_K on the
  layers its `use_more_bits(i, n)` picks (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2: 24 of 48 layers),
  Q4_K on the others; the router (ffn_gate_inp) and norms F32, never quantized. That mix gives 18.5 GB
  (17.3 GiB), the size of the published Q4_K_M files (18.6 GB); Q6_K experts on every layer would
  give 19.8 GB.
- `gpt-oss-20b`: openai/gpt-oss-20b's config.json (24 layers, hidden 2880, 64 query / 8 key-value heads
  of head_dim 64, 32 local experts of which 4 are used, intermediate_size 2880, vocab_size 201088,
  sliding_window 128 on every other layer, rope_theta 150000 with YaRN factor 32 over 4096,
  rms_norm_eps 1e-5). Block types as ggml-org/gpt-oss-20b-GGUF's gpt-oss-20b-mxfp4.gguf (llama.cpp's
  MXFP4_MOE: 3-D expert tensors MXFP4, every other 2-D weight Q8_0): experts MXFP4 with F32 biases,
  attention q / k / v / output Q8_0 with F32 biases, attn_sinks F32, token_embd and output Q8_0, the
  router F32 with its bias, norms F32. 12.1 GB, the published file's size.
- `tiny-qwen3moe`, `tiny-gpt-oss`: the same architectures and types at a few MB, for the tests.

Tensor names, metadata keys and layouts are llama.cpp's (gguf-py's `qwen3moe` and `gpt-oss`), as
the engine's loader reads them. Block bytes are random (numpy's generator, in large arrays) with
their scale fields set so every weight is finite and of a trained model's size (~0.03): the float16
`d` of Q8_0 / Q4_0 / Q6_K and `d`, `dmin` of Q4_K (dmin = 7.5 d, which centres Q4_K's values on
zero), MXFP4's exponent byte drawn from 118..122. The tokenizer is a gpt2-type vocabulary of exactly
`vocab` tokens (GPT-2's 256 byte tokens, 64 merges, filler tokens, the model's control tokens last)
that both engines load; the bench feeds token ids, so what it spells does not matter. The file is
written tensor by tensor (gguf's `GGUFWriter`), under a temporary name renamed once complete, and
reused while its header says it was written by this writer for the same shape and seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

WRITER_VERSION = 1  # bump when the bytes a shape's file holds change: older files are rewritten
MARKER_KEY = "agentfold.bench_moe"  # the header key that says which writer, shape and seed made the file
WEIGHT_STD = 0.03  # the typical size of a weight of a trained model's linear layers
ROUTER_STD = 0.05  # router logits of std ~2 on a normed input: clear but not one-hot choices
MERGES = 64
Say = Callable[[str], None]


@dataclass(frozen=True)
class MoEShape:
    """One model's dimensions and block types, as its GGUF holds them."""

    name: str
    arch: str  # qwen3moe | gpt-oss (general.architecture)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_inner: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    types: dict[str, str]  # tensor part (token_embd, attn_q, ffn_down_exps, ...) -> ggml type
    more_bits: dict[str, str] = field(default_factory=dict)  # part -> type on llama.cpp's use_more_bits layers
    dense_inner: int = 0  # feed_forward_length (qwen3moe: the checkpoint's dense width, which no layer uses)
    sliding_window: int = 0  # gpt-oss: every other layer attends to its last this many keys
    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    label: str = ""  # the file type's name, in the file name
    file_type: str = ""  # gguf.LlamaFileType member
    source: str = ""

    def type_of(self, part: str, layer: int | None = None) -> str:
        if layer is not None and part in self.more_bits and use_more_bits(layer, self.layers):
            return self.more_bits[part]
        return self.types[part]

    def specials(self) -> list[str]:
        return list(GPT_OSS_SPECIALS if self.arch == "gpt-oss" else QWEN_SPECIALS)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers a K-quant mix gives more bits (llama-quant.cpp)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # bos, -, eos
GPT_OSS_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>")  # bos, pad, eos, then harmony's markers
_SPECIAL_IDS = {"qwen3moe": ("<|endoftext|>", "<|im_end|>"), "gpt-oss": ("<|startoftext|>", "<|return|>")}
_PRE_TOKENIZER = {"qwen3moe": "qwen2", "gpt-oss": "gpt-4o"}

_Q4_K_M = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K",
           "attn_output": "Q4_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_K",
           "ffn_gate_inp": "F32"}
_Q4_K_M_MORE = {"attn_v": "Q6_K", "ffn_down_exps": "Q6_K"}
_MXFP4_MOE = {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0",
              "attn_output": "Q8_0", "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4",
              "ffn_gate_inp": "F32"}
_QWEN = {"arch": "qwen3moe", "types": _Q4_K_M, "more_bits": _Q4_K_M_MORE, "label": "Q4_K_M",
         "file_type": "MOSTLY_Q4_K_M", "rope_theta": 10_000_000.0, "rms_eps": 1e-6}
_GPT_OSS = {"arch": "gpt-oss", "types": _MXFP4_MOE, "label": "MXFP4", "file_type": "MOSTLY_MXFP4_MOE",
            "rope_theta": 150_000.0, "rms_eps": 1e-5, "yarn_factor": 32.0, "yarn_original_context": 4096}

SHAPES: dict[str, MoEShape] = {
    "qwen3-coder-30b-a3b": MoEShape(
        name="qwen3-coder-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8,
        expert_inner=768, dense_inner=6144, vocab=151936, context=262144, **_QWEN,
        source="Qwen/Qwen3-Coder-30B-A3B-Instruct config.json; llama.cpp's Q4_K_M mix (llama-quant.cpp)"),
    "gpt-oss-20b": MoEShape(
        name="gpt-oss-20b", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4,
        expert_inner=2880, vocab=201088, context=131072, sliding_window=128, **_GPT_OSS,
        source="openai/gpt-oss-20b config.json; ggml-org/gpt-oss-20b-GGUF's types (llama.cpp's MXFP4_MOE)"),
    "tiny-qwen3moe": MoEShape(
        name="tiny-qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, used=2,
        expert_inner=256, dense_inner=768, vocab=512, context=4096, **_QWEN,
        source="a few-MB qwen3moe of the same layout and types, for the tests"),
    "tiny-gpt-oss": MoEShape(
        name="tiny-gpt-oss", layers=2, hidden=192, heads=4, kv_heads=2, head_dim=64, experts=8, used=4,
        expert_inner=160, vocab=512, context=131072, sliding_window=16, **_GPT_OSS,
        source="a few-MB gpt-oss of the same layout and types, for the tests"),
}
REAL = ("qwen3-coder-30b-a3b", "gpt-oss-20b")  # what `--arch all` runs


def shapes_for(arch: str, layers: int | None = None) -> list[MoEShape]:
    """The shapes `--arch` names (`all`: the real two); `layers`: only the first this many of each."""
    names = list(REAL) if arch == "all" else [arch]
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise ValueError(f"--arch must be one of {', '.join([*SHAPES, 'all'])}, not {arch!r}")
    chosen = [SHAPES[name] for name in names]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, not {layers}")
        chosen = [dataclasses.replace(s, layers=min(layers, s.layers), name=f"{s.name}-{min(layers, s.layers)}l")
                  if layers < s.layers else s for s in chosen]
    return chosen


# -- the tokenizer -------------------------------------------------------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's characters for the 256 byte values (its `bytes_to_unicode`), in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def tokenizer_fields(shape: MoEShape) -> dict[str, Any]:
    """`tokenizer.*` keys of a gpt2-type vocabulary of exactly `shape.vocab` tokens: the byte tokens,
    MERGES merged pairs (llama.cpp wants a merges array), fillers, and the model's control tokens last."""
    alphabet = byte_alphabet()
    letters = "etaoinsrh"
    pairs = [(a, b) for a in alphabet[ord(" ")] + letters for b in letters][:MERGES]
    merged = [a + b for a, b in pairs]
    specials = shape.specials()
    fillers = shape.vocab - len(alphabet) - len(merged) - len(specials)
    if fillers < 0:
        raise ValueError(f"{shape.name}: a vocabulary of {shape.vocab} cannot hold the "
                         f"{len(alphabet) + len(merged) + len(specials)} fixed tokens")
    tokens = alphabet + merged + [f"tok{i}" for i in range(fillers)] + specials
    bos, eos = (tokens.index(text) for text in _SPECIAL_IDS[shape.arch])
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _PRE_TOKENIZER[shape.arch],
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - len(specials)) + [3] * len(specials),
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in pairs],
            "tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.eos_token_id": eos,
            "tokenizer.ggml.add_bos_token": False}


# -- the file ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: str  # ggml type name
    shape: tuple[int, ...]  # numpy order, in values
    fill: str  # blocks | norm | normal
    std: float = WEIGHT_STD

    def nbytes(self) -> int:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        count = int(np.prod(self.shape))
        if self.kind == "F32":
            return 4 * count
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        return count // block * size

    def byte_shape(self) -> tuple[int, ...]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.kind == "F32":
            return self.shape
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        return (*self.shape[:-1], self.shape[-1] // block * size)


def tensor_plan(shape: MoEShape) -> list[TensorSpec]:
    """Every tensor of the file in order, llama.cpp's names, numpy shapes (rows first)."""
    s = shape
    specs = [TensorSpec("token_embd.weight", s.type_of("token_embd"), (s.vocab, s.hidden), "blocks")]
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    gpt_oss = s.arch == "gpt-oss"
    for i in range(s.layers):
        blk = f"blk.{i}"
        specs.append(TensorSpec(f"{blk}.attn_norm.weight", "F32", (s.hidden,), "norm"))
        for part, rows, cols in (("attn_q", q_rows, s.hidden), ("attn_k", kv_rows, s.hidden),
                                 ("attn_v", kv_rows, s.hidden), ("attn_output", s.hidden, q_rows)):
            specs.append(TensorSpec(f"{blk}.{part}.weight", s.type_of(part, i), (rows, cols), "blocks"))
            if gpt_oss:
                specs.append(TensorSpec(f"{blk}.{part}.bias", "F32", (rows,), "normal", 0.02))
        if gpt_oss:
            specs.append(TensorSpec(f"{blk}.attn_sinks.weight", "F32", (s.heads,), "normal", 1.0))
            specs.append(TensorSpec(f"{blk}.post_attention_norm.weight", "F32", (s.hidden,), "norm"))
        else:
            specs.append(TensorSpec(f"{blk}.attn_q_norm.weight", "F32", (s.head_dim,), "norm"))
            specs.append(TensorSpec(f"{blk}.attn_k_norm.weight", "F32", (s.head_dim,), "norm"))
            specs.append(TensorSpec(f"{blk}.ffn_norm.weight", "F32", (s.hidden,), "norm"))
        specs.append(TensorSpec(f"{blk}.ffn_gate_inp.weight", s.type_of("ffn_gate_inp"), (s.experts, s.hidden),
                                "normal", ROUTER_STD))
        if gpt_oss:
            specs.append(TensorSpec(f"{blk}.ffn_gate_inp.bias", "F32", (s.experts,), "normal", 0.1))
        for part, rows, cols in (("ffn_gate_exps", s.expert_inner, s.hidden), ("ffn_up_exps", s.expert_inner, s.hidden),
                                 ("ffn_down_exps", s.hidden, s.expert_inner)):
            specs.append(TensorSpec(f"{blk}.{part}.weight", s.type_of(part, i), (s.experts, rows, cols), "blocks"))
            if gpt_oss:
                specs.append(TensorSpec(f"{blk}.{part}.bias", "F32", (s.experts, rows), "normal", 0.02))
    specs.append(TensorSpec("output_norm.weight", "F32", (s.hidden,), "norm"))
    specs.append(TensorSpec("output.weight", s.type_of("output"), (s.vocab, s.hidden), "blocks"))
    return specs


# Where each block type keeps its scales, and the value that makes its weights ~WEIGHT_STD:
# float16 fields (byte offset, std of the block's values at scale 1), so scale = WEIGHT_STD / that std.
# Q4_K: d * sc * q - dmin * m with sc, m, q random 6-, 6- and 4-bit (std ~258 d at dmin = 7.5 d, the
# dmin that centres them); Q6_K: d * scale * (q - 32), int8 scales (std ~1365 d); Q8_0: int8 (~74 d);
# Q4_0 / Q5_0: q - 8 / q - 16 (~4.6 d / ~9.2 d).
FLOAT16_SCALES = {
    "Q4_K": [(0, 258.0), (2, 258.0 / 7.5)],
    "Q6_K": [(208, 1365.0)],
    "Q8_0": [(0, 74.0)],
    "Q4_0": [(0, 4.6)],
    "Q5_0": [(0, 9.2)],
}
MXFP4_EXPONENTS = (118, 122)  # E8M0 scale bytes: 2^(e-128) x MXFP4's values (rms 5.85): std 0.006-0.09


def tensor_data(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes (uint8 blocks of byte_shape) or float32 values."""
    if spec.kind == "F32":
        values = rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(spec.std)
        return values + np.float32(1.0) if spec.fill == "norm" else values
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[spec.kind]]
    raw = rng.integers(0, 256, size=spec.nbytes(), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    if spec.kind == "MXFP4":
        blocks[:, 0] = rng.integers(MXFP4_EXPONENTS[0], MXFP4_EXPONENTS[1] + 1, size=len(blocks), dtype=np.uint8)
    elif spec.kind in FLOAT16_SCALES:
        for offset, std_at_one in FLOAT16_SCALES[spec.kind]:
            blocks[:, offset : offset + 2] = np.frombuffer(np.float16(spec.std / std_at_one).tobytes(), np.uint8)
    else:
        raise ValueError(f"{spec.name}: the writer has no scale fields for {spec.kind}")
    return raw.reshape(spec.byte_shape())


def _size(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def file_path(shape: MoEShape, cache_dir: Path) -> Path:
    return cache_dir / f"{shape.name}-random-{shape.label}.gguf"


def default_cache_dir() -> Path:
    from agentfold.engine.file_digest import cache_root

    return cache_root() / "bench"


def _marker(shape: MoEShape, seed: int) -> str:
    return json.dumps({"writer": WRITER_VERSION, "seed": seed, "shape": dataclasses.asdict(shape)}, sort_keys=True)


def existing_file(shape: MoEShape, path: Path, seed: int) -> tuple[bool, str]:
    """Whether `path` is this writer's complete file for `shape` and `seed`, and why not."""
    from agentfold.engine.gguf_file import GGUFError, GGUFFile

    if not path.is_file():
        return False, "not written yet"
    try:
        header = GGUFFile(path)  # (it checks that every tensor lies within the file: a truncated one fails)
    except GGUFError as error:
        return False, f"unreadable ({error})"
    marker = header.metadata.get(MARKER_KEY)
    if marker != _marker(shape, seed):
        return False, "written by another version of this bench or for another shape"
    if len(header.tensors) != len(tensor_plan(shape)):
        return False, "its tensors are not this shape's"
    return True, "complete"


def _add_metadata(writer: Any, shape: MoEShape, seed: int) -> None:
    from gguf import LlamaFileType
    from gguf import constants as gguf_constants

    s = shape
    writer.add_name(f"{s.name} (random weights, agentfold bench moe)")
    writer.add_file_type(int(getattr(LlamaFileType, s.file_type)))
    writer.add_quantization_version(gguf_constants.GGML_QUANT_VERSION)
    writer.add_string(MARKER_KEY, _marker(shape, seed))
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.dense_inner or s.expert_inner)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.used)
    writer.add_expert_feed_forward_length(s.expert_inner)
    if s.sliding_window:
        writer.add_sliding_window(s.sliding_window)
    if s.yarn_factor:
        writer.add_rope_scaling_type(gguf_constants.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(s.yarn_original_context)
    for key, value in tokenizer_fields(shape).items():
        add_field(writer, key, value)


def write_random_gguf(shape: MoEShape, path: Path, seed: int = 0, say: Say = print) -> dict[str, Any]:
    """Write `shape`'s random GGUF to `path` (via `<path>.partial`, renamed once complete), tensor by
    tensor; progress about every 5% of the bytes. Returns what was written."""
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType

    plan = tensor_plan(shape)
    total = sum(spec.nbytes() for spec in plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < total + (1 << 30):
        raise ValueError(f"{path.parent} has {free / 1e9:.1f} GB free; {shape.name}'s file needs {total / 1e9:.1f} GB "
                         "(choose another folder with --cache-dir)")
    partial = path.with_name(path.name + ".partial")
    say(f"bench moe: writing {path.name}: {len(plan)} tensors, {_size(total)} of random blocks at "
        f"{shape.name}'s shapes, to {path.parent}")
    began = time.perf_counter()
    writer = GGUFWriter(str(partial), shape.arch)
    _add_metadata(writer, shape, seed)
    for spec in plan:
        if spec.kind == "F32":
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes())
        else:
            writer.add_tensor_info(spec.name, spec.byte_shape(), np.dtype(np.uint8), spec.nbytes(),
                                   raw_dtype=GGMLQuantizationType[spec.kind])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, step, last = 0, max(total // 20, 1), began
        for index, spec in enumerate(plan):
            data = tensor_data(spec, np.random.default_rng([seed, index]))
            writer.write_tensor_data(data)
            before, done = done, done + spec.nbytes()
            del data
            now = time.perf_counter()
            if done // step != before // step and now - last >= 2.0:  # about every 5%, at most every 2 s
                rate = done / (now - began)
                say(f"bench moe: writing {path.name}: {_size(done)} of {_size(total)} ({100 * done / total:.0f}%, "
                    f"{rate / 1e9:.2f} GB/s, about {(total - done) / rate:.0f} s left)")
                last = now
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - began
    say(f"bench moe: wrote {path} ({_size(path.stat().st_size)}) in {seconds:.1f} s")
    return {"written": True, "write_seconds": round(seconds, 1)}


def ensure_file(shape: MoEShape, cache_dir: Path, seed: int = 0, say: Say = print) -> dict[str, Any]:
    """The shape's file in `cache_dir`, written unless this writer's complete file is already there."""
    path = file_path(shape, cache_dir)
    ok, why = existing_file(shape, path, seed)
    if ok:
        say(f"bench moe: reusing {path} ({_size(path.stat().st_size)}, written before for this shape and seed)")
        result: dict[str, Any] = {"written": False, "write_seconds": None}
    else:
        if path.exists():
            say(f"bench moe: {path.name} is {why}: writing it again")
        result = write_random_gguf(shape, path, seed, say)
    from agentfold.engine.gguf_file import GGUFFile

    counts = GGUFFile(path).type_counts()
    return {"path": str(path), "bytes": path.stat().st_size, "gb": round(path.stat().st_size / 1e9, 3),
            "seed": seed, "writer_version": WRITER_VERSION, "tensor_types": counts, **result}


def read_through(path: Path, say: Say) -> float:
    """Read the whole file once (into the page cache, where memory allows) so that each engine
    starts from the same cache; seconds taken."""
    began, size, done, last = time.perf_counter(), path.stat().st_size, 0, time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(64 << 20)
        view = memoryview(buffer)
        while True:
            count = handle.readinto(view)
            if not count:
                break
            done += count
            if time.perf_counter() - last > 15:
                say(f"bench moe: reading {path.name} into the page cache: {done / 1e9:.1f} / {size / 1e9:.1f} GB")
                last = time.perf_counter()
    return time.perf_counter() - began


def add_field(writer: Any, key: str, value: Any) -> None:
    """A metadata key in the GGUF type its Python value calls for (lists as arrays, ints as uint32)."""
    if isinstance(value, (list, np.ndarray)):
        writer.add_array(key, list(value))
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    else:
        writer.add_uint32(key, int(value))
