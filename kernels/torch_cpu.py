"""Row-exact CPU kernels for the torch backend: row j of a k-row call gives a one-row call's bits.

Matmul: torch's CPU GEMM (MKL or OpenBLAS) computes a row with the same arithmetic for every
height up to a shape-dependent limit (MKL on AVX2: 12 rows when k = 576, 3 when k = 64), then
switches kernels. `linear` finds that limit once per weight shape by comparing real calls on a
probe, and cuts wider passes into blocks of at most that many rows: exact at any width, and a
block still reads the weights once for all of its rows.

Attention: every pass, decode, verify and prefill chunk alike, runs every lane of a layer in one C
call, `lane_attention` (csrc/lane_attention.c: each query row in a fixed order of its own, so a
prefill chunk's cache rows have the bits they would have in any other chunking); without a
compiler each query row of a decode or verify pass attends on its own through the very call a
one-row step makes (same shapes, same keys 0..position), and wider passes are prefill chunks,
computed in batched blocks of query rows: those follow the prefill plan, the same for fresh and
resumed prompts. (Until VERSION 5 prefill chunks took the batched blocks with the C kernel too:
the C call is 1.5-2x faster there, 2x at 8K tokens of context, where the blocks' float32 score
matrices ran to 80 MB.) Since VERSION 6 a long prefill chunk (`MATRIX_MIN_ROWS`) attends on the
CPU's matrix tiles where it has AMX-BF16: still one row's arithmetic of its own, but other bits
than a decode row's, so only chunks the prefill plan cuts take it.

Row-wise ops (norms, softmax, SiLU): `rows_alike` says when torch's own kernel already gives
every row a one-row call's arithmetic (reductions over rows shorter than a thread's grain; exp on
whole vector chunks in one thread). Otherwise (huge rows, odd widths, wide passes of exp, where
a reduction splits across threads or a row straddles the scalar tail) each row is its own call.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from agentfold.kernels import native

VERSION = 7  # bump when any kernel's arithmetic changes (it is part of snapshot keys); 5: lane attention sums by
# key lanes, and prefill chunks attend through it too; 6: long prefill chunks on AMX-BF16 tiles (MATRIX_MIN_ROWS);
# 7: their softmax's exponentials in fused multiply-adds (`matrix_exp`)
PER_ROW_LIMIT = 64  # passes wider than this are prefill chunks: batched, not row-exact
# A lane of a prefill chunk (a pass inside `prefill_chunk()`) with at least this many rows attends on
# the matrix tiles where the CPU has AMX-BF16 (csrc/lane_attention.c, `lane_attention_prefill`):
# ~2.5x less CPU time for 512 rows over 4K-12K keys, other bits than the vector path a decode row
# takes. Which path a row takes must be fixed by the prefill plan (DESIGN contract 2), never by what
# shares its pass or how a driver cut it: `prefill_chunk()` is entered by the backends' prefill
# steps (a chunk of the plan, or a prompt request run alone), and prompt rows that may ride in a
# shared pass (`forward_many`, outside `prefill_chunk()` anyway), where the scheduler
# cuts them to what fits beside the replies' rows, come in requests of at most
# `engine.decode.PROMPT_PASS_MAX` (128) rows: always below this, so they stay on the vectors in
# every case. A chunk of 129 rows or more is therefore always a whole chunk between two cuts of the
# plan, the same for fresh and resumed prompts. (Decode and verify passes never enter
# `prefill_chunk()`; the C decoder layer, which runs passes of up to 128 rows, calls the vector
# path.) Each row's bits on the tiles depend only on its own query, keys and values, so the rows
# of the chunk also agree across thread counts and with whatever else shares the call.
MATRIX_MIN_ROWS = 129
PREFILL_BLOCK = 256  # query rows per batched attention call (bounds the score matrix)
PROBE_ROWS = 16  # the widest block `linear` checks for
GRAIN = 32768  # at::internal::GRAIN_SIZE: tensors with fewer elements run on one thread
CHUNK = 64  # a multiple of any CPU vector loop's stride (2 x 16 floats on AVX-512)
_BLOCK_ROWS: dict[tuple, int] = {}
_PREFILL = threading.local()  # set by `prefill_chunk()` on the thread running a prefill


@contextmanager
def prefill_chunk() -> Iterator[None]:
    """Run the passes inside as prefill: batched kernels at any width, no per-row work.

    A prefill chunk's logits are never read, and its cache rows must only equal those of the same
    chunk on the same plan (fresh or resumed prefills cut at the same places), not a one-row
    pass's. Without this, a short chunk (the new message of a resumed turn) took the verify
    path: every row alone through attention and the row-wise ops (~2x slower at 5K tokens).
    """
    before = getattr(_PREFILL, "on", False)
    _PREFILL.on = True
    try:
        yield
    finally:
        _PREFILL.on = before


def _batched(m: int) -> bool:
    """Whether a pass of `m` rows may use batched kernels (one row, a wide pass, or a prefill chunk)."""
    return m == 1 or m > PER_ROW_LIMIT or getattr(_PREFILL, "on", False)


def aligned_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight [n, k].T with x's rows at a 64-byte aligned address (a copy where they are not)."""
    if x.data_ptr() % 64:  # a GEMM's arithmetic may depend on alignment: give it aligned rows
        x = x.clone(memory_format=torch.contiguous_format)
    return torch.mm(x, weight.t())


def block_rows(weight: torch.Tensor) -> int:
    """The widest height up to PROBE_ROWS at which every row of a GEMM with `weight` equals a
    one-row call (checked on a fixed probe, once per shape, layout, dtype and thread count)."""
    n, k = weight.shape
    key = (n, k, weight.dtype, weight.stride(), torch.get_num_threads())
    if key not in _BLOCK_ROWS:
        probe = torch.randn(PROBE_ROWS, k, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        single = [aligned_mm(probe[i : i + 1].clone(), weight) for i in range(PROBE_ROWS)]
        rows = 1
        for m in range(2, PROBE_ROWS + 1):
            out = aligned_mm(probe[:m].clone(), weight)
            if not all(torch.equal(out[i : i + 1], single[i]) for i in range(m)):
                break
            rows = m
        _BLOCK_ROWS[key] = rows
    return _BLOCK_ROWS[key]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T, in blocks no taller than `block_rows(weight)` (row-exact)."""
    m = x.shape[0]
    if _batched(m):
        return aligned_mm(x, weight)
    step = block_rows(weight)
    if m <= step:
        return aligned_mm(x, weight)
    return torch.cat([aligned_mm(x[i : i + step], weight) for i in range(0, m, step)])


def rows_alike(m: int, d: int, transcendental: bool) -> bool:
    """Whether torch computes each row of an [m, d] tensor as it computes that row alone.

    A reduction along rows shorter than GRAIN runs row by row in the same inner loop (a longer
    lone row is split across threads). Elementwise exp / tanh also need every element on the
    same side of the vector-loop / scalar-tail split: whole vector chunks per row, one thread.
    """
    if d >= GRAIN:
        return False
    return not transcendental or (d % CHUNK == 0 and m * d < GRAIN)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, transcendental: bool) -> torch.Tensor:
    """fn(x) for a row-wise fn, each row with the bits of fn on that row alone."""
    m, d = x.shape
    if _batched(m) or rows_alike(m, d, transcendental):
        return fn(x)
    step = max(1, (GRAIN - 1) // d) if rows_alike(1, d, transcendental) else 1  # blocks that stay alike
    return torch.cat([fn(x[i : i + step]) for i in range(0, m, step)])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x [m, d] over its root mean square (float32 math), times weight [d]."""
    return rowwise(lambda rows: _rms_norm(rows, weight, eps), x, transcendental=False)  # rsqrt is exact


def silu(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.silu, x, transcendental=True)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.sigmoid, x, transcendental=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of x [m, d], in float32."""
    return rowwise(lambda rows: torch.softmax(rows.float(), dim=-1), x, transcendental=True)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of float32 scores [kv_heads, group, ..., L], with `sinks` (one logit
    per query head, [kv_heads * group]; gpt-oss) as one more term of each row that has no value:
    transformers' `eager_attention_forward` (the sink's column appended, the softmax, the column
    dropped; torch's softmax subtracts the row's largest, the sink included). None: the plain softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(device=scores.device, dtype=scores.dtype).view(*scores.shape[:2], *[1] * (scores.dim() - 2))
    combined = torch.cat([scores, column.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row q [heads, d] over all of k, v [kv_heads, L, d] (grouped-query attention);
    `sinks` [heads]: each head's sink logit (`sink_softmax`)."""
    kv_heads, _, d = k.shape
    grouped = q.reshape(kv_heads, -1, d)
    scores = torch.matmul(grouped, k.transpose(1, 2)).float() * scale
    probs = sink_softmax(scores, sinks).to(v.dtype)
    return torch.matmul(probs, v).reshape(q.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention: q [heads, m, d]; row i sees keys 0..q_positions[i] of k, v [kv_heads, L, d];
    `sinks` [heads]: each head's sink logit (`sink_softmax`). (Plain torch: on CUDA too, for sinks.)"""
    m = q.shape[1]
    positions = q_positions.tolist()
    if m <= PER_ROW_LIMIT and not getattr(_PREFILL, "on", False):  # one row too: decode rows attend alone
        rows = [attend_row(q[:, i], k[:, : p + 1], v[:, : p + 1], scale, sinks) for i, p in enumerate(positions)]
        return torch.stack(rows, dim=1)
    blocks = []
    for first in range(0, m, PREFILL_BLOCK):
        last = min(first + PREFILL_BLOCK, m)
        end = max(positions[first:last]) + 1
        blocks.append(attend_block(q[:, first:last], k[:, :end], v[:, :end], q_positions[first:last], scale, sinks))
    return torch.cat(blocks, dim=1)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                 scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Query rows q [heads, m, d] over k, v [kv_heads, L, d] with a causal mask, in two matmuls
    (`sinks` [heads]: each head's sink logit, `sink_softmax`).

    (torch's CPU flash attention with a mask is 3-30x slower than this at prefill sizes.)
    """
    heads, m, d = q.shape
    kv_heads, length, _ = k.shape
    grouped = q.reshape(kv_heads, (heads // kv_heads) * m, d)  # head h reads kv head h // group
    scores = (torch.matmul(grouped, k.transpose(1, 2)).float() * scale).view(kv_heads, -1, m, length)
    hidden = torch.arange(length, device=k.device)[None, :] > q_positions[:, None]
    probs = sink_softmax(scores.masked_fill(hidden, float("-inf")), sinks).to(v.dtype)
    return torch.matmul(probs.view(kv_heads, -1, length), v).view(heads, m, d)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_LANE_SIGNATURE = {"lane_attention": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                                      ctypes.c_float, _I64, ctypes.c_int, _I64, _PTR, _I64, _PTR, _I64, _I64],
                   "lane_attention_sinks": [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                                            ctypes.c_float, _I64, ctypes.c_int, _I64, _PTR, _I64, _PTR, _I64, _I64,
                                            _I64, _PTR],
                   "lane_attention_fused": ([], ctypes.c_int), "lane_attention_halves": ([], ctypes.c_int),
                   "lane_attention_matrix": ([], ctypes.c_int), "lane_attention_matrix_rows": ([], _I64)}
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1}  # the caches the C kernel reads (value: its `half` flag)
LaneKV = tuple[int, int, int, torch.Tensor, torch.Tensor]  # rows begin, rows, start, keys, values [kv_heads, cap, d]


def block_keys(keys: torch.Tensor) -> torch.Tensor:
    """Keys [kv_heads, cap, d] (cap a multiple of 16) in `LayerCache`'s blocked layout
    [kv_heads, cap / 16, d, 16] (a copy)."""
    kv_heads, cap, d = keys.shape
    return keys.reshape(kv_heads, cap // 16, 16, d).transpose(2, 3).contiguous()


def lane_library() -> ctypes.CDLL | None:
    """The kernels' library with csrc/lane_attention.c's functions (built on first use, `native`)."""
    return native.load(_LANE_SIGNATURE)


def attention_kernel() -> str:
    """Which kernel runs decode and verify attention here (part of a snapshot key)."""
    lib = lane_library()
    if lib is None:
        return "torch per row"
    name = "lane_attention.c/fma" if lib.lane_attention_fused() else "lane_attention.c"
    return name + "+amx-bf16-prefill" if lib.lane_attention_matrix() else name


class LaneTable:
    """The C attention's view of a pass's lanes, built once per pass for all of its layers.

    Per lane its rows (begin, count) and start position, per layer every lane's cache addresses,
    as the C arrays the kernel reads: a layer's call then costs the same however many lanes share
    the pass (one call; the kernel also stores the rows' new keys and values). The caches must
    have room for the pass's rows before the table is made (`LayerCache.reserve`), so that no
    address changes while the pass runs. `layers`: per layer the caches' dtype, kv heads and key
    layout (blocked or not), and per lane (capacity, keys' address, values' address) of caches
    that are contiguous, in that dtype and layout: `lane_table` checks tensors for it, the model's
    own caches hold it by construction (`LayerCache.addresses`).
    """

    def __init__(self, spans: Sequence[tuple[int, int, int]],
                 layers: Sequence[tuple[torch.dtype, int, bool, Sequence[tuple[int, int, int]]]]) -> None:
        count = len(spans)
        column = ctypes.c_int64 * count
        self.count = count
        self.rows = sum(rows for _, rows, _ in spans)
        self.begin, self.lengths, self.start = (column(*c) for c in zip(*spans, strict=True))
        flat: list[int] = []  # per layer: the lanes' capacities, keys' addresses, values' addresses
        for *_, addresses in layers:
            for part in zip(*addresses, strict=True):
                flat.extend(part)
        self.addresses = (ctypes.c_int64 * len(flat))(*flat)
        base, size = ctypes.addressof(self.addresses), ctypes.sizeof(column)
        self.layers = [(base + 3 * slot * size, base + (3 * slot + 1) * size, base + (3 * slot + 2) * size,
                        CACHE_DTYPES[dtype], kv_heads, int(blocked))
                       for slot, (dtype, kv_heads, blocked, _) in enumerate(layers)]

    def attend(self, layer: int, q: torch.Tensor, new_keys: torch.Tensor | None, new_values: torch.Tensor | None,
               scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `layer`'s attention of every lane: q [m, heads, d] float32 (lane after lane) -> [m, heads, d].
        `new_keys` / `new_values` [m, kv_heads, d] (float32, rows may be strided): the rows' own keys
        and values, stored into each lane's cache at its positions first (None: already there).
        `sinks` [heads] (float32; gpt-oss): each query head's sink logit, one more term of its
        softmax with no value, on every path of the kernel (None: the kernel's bits without sinks)."""
        capacity, keys, values, half, kv_heads, blocked = self.layers[layer]
        m, heads, d = q.shape
        if sinks is not None:
            if sinks.shape != (heads,):
                raise ValueError(f"sinks must be one logit per query head, [{heads}], not {tuple(sinks.shape)}")
            sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
        q = q.contiguous()
        out = torch.empty_like(q)
        written = []
        for new in (new_keys, new_values):
            if new is None:
                written.append((None, 0))
                continue
            if new.dtype != torch.float32 or new.stride(2) != 1 or new.stride(1) != d:
                new = new.float().contiguous()
            written.append((new.data_ptr(), new.stride(0)))
        matrix = MATRIX_MIN_ROWS if getattr(_PREFILL, "on", False) else 0  # (see MATRIX_MIN_ROWS)
        lane_library().lane_attention_sinks(q.data_ptr(), out.data_ptr(), heads, kv_heads, d, self.count,
                                            self.begin, self.lengths, self.start, capacity, keys, values, scale,
                                            window or 0, torch.get_num_threads(), half, written[0][0],
                                            written[0][1], written[1][0], written[1][1], blocked, matrix,
                                            None if sinks is None else sinks.data_ptr())
        return out


def reads_cache(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C lane attention reads a cache on `device` in `dtype`: on the CPU, float32 or
    float16, where the library was built (checked in that order: a CUDA cache never builds it)."""
    return device.type == "cpu" and dtype in CACHE_DTYPES and lane_library() is not None


def lane_table(spans: Sequence[tuple[int, int, int]],
               layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> LaneTable | None:
    """The pass's `LaneTable` where the C kernel runs its attention (any pass: decode, verify, a
    prefill chunk); None where it does not apply (no compiler, a cache the kernel does not read):
    the model then runs `attention` per lane. Decided by the model alone, so a reply's rows never
    change kernels. `layers[slot][lane]`: keys and values; ValueError where a layer's caches are not
    contiguous or differ in dtype or key layout."""
    if not layers or not reads_cache(layers[0][0][0].device, layers[0][0][0].dtype):
        return None
    described = []
    for caches in layers:
        keys = caches[0][0]
        for k, v in caches:
            if not (k.is_contiguous() and v.is_contiguous()) or k.dtype != keys.dtype or v.dtype != keys.dtype:
                raise ValueError("lane caches must be contiguous, of one dtype")
            if k.dim() != keys.dim() or (k.dim() == 4 and k.shape[1] * k.shape[3] != v.shape[1]):
                raise ValueError("lane caches must share one key layout (blocked keys: 16 positions a block)")
        described.append((keys.dtype, keys.shape[0], keys.dim() == 4,
                          [(v.shape[1], k.data_ptr(), v.data_ptr()) for k, v in caches]))
    return LaneTable(spans, described)


def cache_table(spans: Sequence[tuple[int, int, int]], layers: Sequence[Sequence[Any]]) -> LaneTable | None:
    """`lane_table` over caches that note their own addresses (`LayerCache`: contiguous, one dtype
    and key layout, `addresses` kept as the tensors change): three ints read per layer and lane,
    nothing checked (a pass of 8 lanes' table in ~0.1 ms instead of ~0.8)."""
    if not layers or not layers[0] or not reads_cache(layers[0][0].keys.device, layers[0][0].keys.dtype):
        return None
    return LaneTable(spans, [(caches[0].keys.dtype, caches[0].keys.shape[0], caches[0].blocked,
                              [cache.addresses for cache in caches]) for caches in layers])


def lane_attention(q: torch.Tensor, lanes: Sequence[LaneKV], scale: float, window: int | None,
                   blocked: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode / verify attention of every lane of a pass in one C call: q [m, heads, d] (lane after
    lane) -> [m, heads, d]; a lane's row at position p sees its own cache's keys 0..p (with a
    `window`, the last `window` of them). Row-exact by construction (csrc/lane_attention.c), and a
    lane's keys and values are read once for all of its rows. `blocked`: hand the kernel the keys in
    `LayerCache`'s blocked layout (copies; capacities a multiple of 16), as the model's caches are.
    `sinks` [heads]: each query head's sink logit (`LaneTable.attend`). None where it does not apply
    (see `lane_table`; also queries in another dtype than float32): the caller runs `attention` per
    lane."""
    if q.dtype != torch.float32:
        return None
    layer = [(block_keys(keys) if blocked else keys.contiguous(), values.contiguous()) for _, _, _, keys, values in lanes]
    table = lane_table([(begin, rows, start) for begin, rows, start, _, _ in lanes], [layer])
    return None if table is None else table.attend(0, q, None, None, scale, window, sinks)
