"""Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3 dense), in the spirit of gpt-fast.

One sequence, no batch axis: a pass takes token ids [m] at positions start..start+m, writes their
keys / values into a static per-layer cache and returns logits [m, vocab]. Every matmul, norm and
attention goes through `ops`, which routes it to a row-exact kernel for the tensor's device; the
rest (RoPE, SiLU, residual adds) is elementwise. Parameter names match Hugging Face checkpoints,
so a safetensors state dict loads as is.

Family differences are flags: Qwen2 has q/k/v biases, Qwen3 RMS-normalizes q and k per head,
SmolLM2 ties the output head to the embedding. Gemma 3 (`gemma3`) reuses these pieces through
their hooks: the norm class, the MLP's gated activation, an attention window and scale, a per-layer
RoPE table and a scaled embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.kernels import decoder_layer
from agentfold.kernels.block_linear import BlockLinear
from agentfold.kernels.decoder_layer import LayerKernel
from agentfold.kernels.int8_linear import Int8Weight


@dataclass
class ModelArgs:
    """The numbers a decoder is built from, read from a Hugging Face config.json dict."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config["model_type"]
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        bias = bool(config.get("attention_bias", False))
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"rope_scaling type {kind!r} is not supported by the torch backend")
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config.get("intermediate_size", 0)),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias or model_type in ("qwen2", "qwen2_moe"),
            o_bias=bias and model_type not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )


@dataclass(frozen=True)
class SequencePass:
    """One sequence's share of a pass: `rows` tokens appended to its per-layer `caches` at `start`."""

    caches: list[LayerCache]
    start: int
    rows: int


@dataclass(frozen=True)
class Lane:
    """A `SequencePass` as one layer sees it: rows begin..begin+rows of the pass at positions
    start.., and that layer's cache."""

    begin: int
    rows: int
    cache: LayerCache
    start: int


@dataclass(frozen=True)
class LayerLanes:
    """A pass's lanes as one layer sees them (`spans`: each lane's rows begin, count and start
    position; `caches`: its cache of this layer), with what every layer of the pass shares: the
    rows' absolute positions (one tensor), one past the highest, and the C attention's table of
    the lanes (`ops.lane_table`; None where the pass runs attention lane by lane) with this layer's
    slot in it."""

    spans: Sequence[tuple[int, int, int]]
    caches: Sequence[LayerCache]
    positions: torch.Tensor
    end: int
    table: Any
    slot: int

    @property
    def lanes(self) -> list[Lane]:
        """Each lane as a `Lane`, for attention lane by lane: made only there (the C table needs
        none; 30 layers x 8 lanes of them cost ~0.2 ms a pass)."""
        return [Lane(begin, rows, cache, start) for (begin, rows, start), cache in zip(self.spans, self.caches,
                                                                                       strict=True)]


class Linear(nn.Module):
    """weight [out, in] (+ bias), applied through the row-exact `ops.linear`."""

    def __init__(self, inputs: int, outputs: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, inputs), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(outputs), requires_grad=False) if bias else None
        # the weight ops.linear uses once quantized: int8 (`quantize.int8_weights`) or the GGUF's blocks (`gguf_blocks`)
        self.quantized: Int8Weight | BlockLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.quantized if self.quantized is not None else self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of weight [vocab, hidden] (a gather: exact for any number of rows)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """Rotary embedding (Hugging Face's half-split layout) from a cos / sin table by position.

    The table is computed in float64 in blocks of a fixed number of positions, each block by the
    same call, so a position's entry has the same bits however long the table has grown.
    """

    BLOCK = 1024

    def __init__(self, head_dim: int, theta: float, factor: float = 1.0, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0) -> None:
        """`factor`: linear RoPE scaling (positions divided by it, as Hugging Face's `linear` type);
        `inv_freq` (float64 [head_dim / 2]) and `attention_factor` (cos and sin scaled by it): a
        scaled RoPE's own frequencies (YaRN: `gpt_oss.yarn_frequencies`)."""
        super().__init__()
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)) / factor
        self.inv_freq = inv_freq.to(torch.float64)
        self.attention_factor = attention_factor
        self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim), persistent=False)

    def _grow(self, length: int) -> None:
        blocks, sines = [self.cos.float()], [self.sin.float()]
        for begin in range(self.cos.shape[0], length, self.BLOCK):
            positions = torch.arange(begin, begin + self.BLOCK, dtype=torch.float64)
            angles = torch.outer(positions, self.inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos(), angles.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            blocks.append(cos.to(torch.float32).to(self.cos.device))
            sines.append(sin.to(torch.float32).to(self.sin.device))
        self.cos, self.sin = torch.cat(blocks), torch.cat(sines)

    def tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos / sin tables [length, head_dim] (float32), grown to hold positions below `end`."""
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos, self.sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, end: int) -> torch.Tensor:
        """Rotate x [m, heads, head_dim], row i for absolute position positions[i] (all below
        `end`), in float32: per element the same arithmetic whichever rows share the call."""
        self.tables(end)
        if x.dtype == torch.float32:
            rotated = ops.rope(x, positions, self.cos, self.sin)  # CPU: one C call, the same bits
            if rotated is not None:
                return rotated
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention; `window` (None: all earlier keys) limits a row to its last `window` keys."""

    def __init__(self, args: ModelArgs, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = 1.0 / math.sqrt(args.head_dim)
        self.window: int | None = None
        hidden, q_size, kv_size = args.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_size, args.qkv_bias)
        self.k_proj = Linear(hidden, kv_size, args.qkv_bias)
        self.v_proj = Linear(hidden, kv_size, args.qkv_bias)
        self.o_proj = Linear(q_size, hidden, args.o_bias)
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.qkv: Fused | None = None  # q, k, v in one GEMM (int8 weights: one quantization of x)
        self.sinks: torch.Tensor | None = None  # a logit per head that takes softmax mass and adds no value (gpt-oss)

    def forward(self, x: torch.Tensor, lanes: LayerLanes, rope: Rope) -> torch.Tensor:
        """x [m, hidden]: the rows of every lane. The projections and RoPE run over all rows at once
        (a row's arithmetic is independent of the others, and RoPE takes each row's own position);
        each lane's rows are stored in and attend to its own cache (`ops.attend_lanes`)."""
        m, d = x.shape[0], self.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(m, self.heads, d), k.view(m, self.kv_heads, d), v.view(m, self.kv_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, d)).view(m, self.heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(m, self.kv_heads, d)
        q, k = rope(q, lanes.positions, lanes.end), rope(k, lanes.positions, lanes.end)
        out = ops.attend_lanes(q, k, v, lanes, self.scale, self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(m, self.heads * d))


# Passes of up to this many rows (decode, verify, prompt pieces in shared passes) run a plain layer in
# one C call (`attach_layer_kernels`); wider ones, prefill chunks, run the modules.
LAYER_KERNEL_ROWS = 128
# Rows of a pass's MLP at a time on the CPU with integer weights (row-exact by construction, so the
# split moves no bit): a whole prefill chunk (512 rows) in one call, so that the AMX block kernels
# unpack each weight once a chunk, not four times (2K-token prefill of the coder model ~6% faster
# than 128-row slices); its gate / up output (37 MB) and gated rows stay in the heap, which
# `native.keep_heap` has keep freed blocks of that size rather than map and fault in fresh pages.
MLP_ROWS = 512


class MLP(nn.Module):
    """Gated feed-forward: down(gated(gate(x), up(x))), gated = activation(gate) * up; SwiGLU unless
    told (Gemma: GELU-tanh)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ops.silu_mul) -> None:
        super().__init__()
        self.gated = gated
        self.gate_proj = Linear(hidden, intermediate, bias)
        self.up_proj = Linear(hidden, intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)
        self.gate_up: Fused | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MLP_ROWS and x.dim() == 2 and not x.is_cuda and self.down_proj.quantized is not None:
            return torch.cat([self._rows(x[start : start + MLP_ROWS]) for start in range(0, x.shape[0], MLP_ROWS)])
        return self._rows(x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.gated(gate, up))


class Fused(nn.Module):
    """Linears that read the same input, as one GEMM whose output columns are split afterwards."""

    def __init__(self, linears: list[Linear], weight: Int8Weight | BlockLinear | torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.sizes = [linear.weight.shape[0] if linear.quantized is None else linear.quantized.shape[0] for linear in linears]
        biases = [linear.bias for linear in linears]
        if all(b is None for b in biases):
            self.bias = None
        else:
            self.bias = torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes,
                                                                                        strict=True)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(ops.linear(x, self.weight, self.bias), self.sizes, dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp
        self.kernel: LayerKernel | None = None  # the whole layer in one C call (`attach_layer_kernels`)

    def forward(self, x: torch.Tensor, lanes: LayerLanes, rope: Rope) -> torch.Tensor:
        if self.kernel is not None and lanes.table is not None and x.shape[0] <= LAYER_KERNEL_ROWS and \
                x.dtype == torch.float32 and not x.is_cuda:
            cos, sin = rope.tables(lanes.end)
            return self.kernel.run(x.contiguous(), lanes.positions, cos, sin, lanes.table, lanes.slot)
        h = x + self.self_attn(self.input_layernorm(x), lanes, rope)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Hugging Face's `model.*`: embedding, decoder layers, final norm."""

    def __init__(self, args: ModelArgs, layers: list[nn.Module], norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """A decoder-only model over one sequence with a static KV cache."""

    norm_class: type[RMSNorm] = RMSNorm  # the final norm's class (Gemma: its 1 + weight norm)
    cache_dtype: torch.dtype | None = None  # the KV cache's dtype (None: the weights'; the CPU int8 path: float16)

    def __init__(self, args: ModelArgs, layers: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.args = args
        if layers is None:
            layers = [DecoderLayer(args, MLP(args.hidden_size, args.intermediate_size, args.mlp_bias))
                      for _ in range(args.num_hidden_layers)]
        self.model = Backbone(args, layers, self.norm_class)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        self.rope = Rope(args.head_dim, args.rope_theta)
        self.head_quantized: Int8Weight | BlockLinear | None = None  # the output head, quantized (tied heads too)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states [m, hidden] the first layer reads for tokens [m]."""
        return self.model.embed_tokens(tokens)

    def rope_for(self, layer: nn.Module) -> Rope:
        """The RoPE table `layer` rotates with (one for all layers here)."""
        return self.rope

    def layer_steps(self, tokens: torch.Tensor, cache: list[LayerCache], start: int,
                    final: list[torch.Tensor] | None = None) -> Iterator[None]:
        """The decoder layers over tokens [m] of one sequence, one at a time, yielding after each
        (the last hidden state goes to `final`): a scheduler can run other work between the layers
        of a prefill. The arithmetic is `forward`'s own: it runs through this too."""
        return self.lane_steps(tokens, [SequencePass(cache, start, tokens.shape[0])], final)

    def lane_steps(self, tokens: torch.Tensor, passes: Sequence[SequencePass],
                   final: list[torch.Tensor] | None = None) -> Iterator[None]:
        """`layer_steps` over the rows of several sequences at once: tokens [m] holds each pass's
        rows in turn, and every row attends only to its own sequence's cache."""
        return self.stage_steps(self.embed(tokens), passes, range(len(self.model.layers)), final)

    def stage_steps(self, h: torch.Tensor, passes: Sequence[SequencePass], layers: range,
                    final: list[torch.Tensor] | None = None) -> Iterator[None]:
        """Decoder layers `layers` over hidden states h [m, hidden] (the rows of `passes`, in
        turn), yielding after each: the whole model, or a pipeline stage's share of it."""
        spans, begin = [], 0
        for one in passes:
            spans.append((begin, one.rows, one.start))
            begin += one.rows
            end = one.start + one.rows
            for index in layers:  # room for the pass's rows now: no cache moves while the pass runs
                cache = one.caches[index]
                if cache.values.shape[1] < end:  # (the check inline: a call per layer and lane cost ~1 ms a pass)
                    cache.reserve(end)
        if begin != h.shape[0]:
            raise ValueError(f"the passes hold {begin} rows, the hidden states {h.shape[0]}")
        positions = torch.cat([torch.arange(one.start, one.start + one.rows) for one in passes]).to(h.device)
        end = max(one.start + one.rows for one in passes)
        caches = [[one.caches[index] for one in passes] for index in layers]
        table = ops.lane_table(spans, caches)
        for slot, index in enumerate(layers):
            layer = self.model.layers[index]
            h = layer(h, LayerLanes(spans, caches[slot], positions, end, table, slot), self.rope_for(layer))
            yield
        if final is not None:
            final.append(h)

    def make_cache(self) -> list[LayerCache]:
        weight = self.model.embed_tokens.weight
        dtype = self.cache_dtype or weight.dtype
        blocked = ops.blocked_keys(weight.device, dtype)
        return [LayerCache(self.args.num_key_value_heads, self.args.head_dim, dtype, weight.device, blocked)
                for _ in self.model.layers]

    def forward(self, tokens: torch.Tensor, cache: list[LayerCache], start: int,
                logits: bool = True) -> torch.Tensor | None:
        """Logits [m, vocab] (float32) of tokens [m] at positions start..start+m; None if not `logits`."""
        return self.forward_passes(tokens, [SequencePass(cache, start, tokens.shape[0])], logits)

    def forward_passes(self, tokens: torch.Tensor, passes: Sequence[SequencePass], logits: bool = True,
                       rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [m, vocab] of the rows of several sequences' passes run as one (see `lane_steps`);
        with `rows` (indices), of those rows only (a pass's prompt rows need none; the head is a row's
        own arithmetic, so which rows it runs on changes no bit)."""
        final: list[torch.Tensor] = []
        for _ in self.lane_steps(tokens, passes, final):
            pass
        if not logits:
            return None
        h = final[0] if rows is None else final[0].index_select(0, rows)
        if not h.shape[0]:
            return h.new_zeros(0, self.args.vocab_size, dtype=torch.float32)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [m, vocab] of the last layer's hidden states h [m, hidden]."""
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        if self.head_quantized is not None:
            head = self.head_quantized
        return ops.linear(self.model.norm(h), head).float()


def attach_layer_kernels(model: Transformer) -> int:
    """Give each plain Llama / Qwen2 layer whose linears all run on GGUF blocks its `LayerKernel`:
    passes of up to LAYER_KERNEL_ROWS rows (decode, verify) then run the layer in one C call, the same
    kernels with the same arguments as the modules (the same bits, fewer ~10 us hops between them).
    Other layers (Gemma's, Qwen3's q / k norms, int8 or float weights) keep the modules. Returns how
    many layers got one."""
    if decoder_layer.library() is None:
        return 0
    attached = 0
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        plain = (type(layer) is DecoderLayer and type(attention) is Attention and type(mlp) is MLP
                 and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                 and attention.q_norm is None and attention.sinks is None and mlp.gated is ops.silu_mul
                 and model.rope_for(layer) is model.rope and type(model.rope) is Rope)
        if not plain or attention.qkv is None or mlp.gate_up is None or mlp.gate_up.bias is not None or \
                mlp.down_proj.bias is not None:
            continue
        linears = (attention.qkv.weight, attention.o_proj.quantized, mlp.gate_up.weight, mlp.down_proj.quantized)
        if not all(isinstance(linear, BlockLinear) for linear in linears):
            continue
        norm = layer.input_layernorm
        layer.kernel = LayerKernel(norm.weight, layer.post_attention_layernorm.weight, norm.eps, attention.heads,
                                   attention.kv_heads, attention.head_dim, attention.scale, attention.window,
                                   linears[0], attention.qkv.bias, linears[1], attention.o_proj.bias, linears[2],
                                   linears[3])
        attached += 1
    return attached
