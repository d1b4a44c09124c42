"""Batch-invariant Triton kernels for the CUDA path: linear, RMS norm, causal GQA attention.

Row j of an m-row call gives the bits of a one-row call, because nothing a row computes depends
on m: every kernel runs one fixed tile configuration (no split-K, no autotuning, no choice made
from the number of rows), the row count is never specialized into the compiled kernel
(`do_not_specialize`), a norm row is one program, and attention splits the keys at fixed
absolute positions (`ATTENTION_SPLIT`) and combines a row's splits in order, so a row's work
depends only on its own position, never on how many other rows or keys the call holds.

Triton also compiles a variant per pointer alignment, which can change how a reduction is laid
out over threads: the norm's input is never specialized on alignment, and the other kernels get
allocator-aligned bases (fresh tensors, cache buffers) in every call a model makes.

Each kernel has a pure-torch reference (`*_reference`) it must match to rounding. With
TRITON_INTERPRET=1 they run on CPU tensors (slowly), which is how the tests check them without a
GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

VERSION = "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LINEAR_TILE = (16, 64, 64)  # BLOCK_M, BLOCK_N, BLOCK_K: fixed for every call
ATTENTION_SPLIT = 16 if INTERPRETED else 256  # keys per split, at absolute positions 0, S, 2S, ...
ATTENTION_BLOCK = 16 if INTERPRETED else 64  # keys per inner step within a split
ATTENTION_ROWS = 256  # query rows per launch (bounds the partials' memory; a row's result is the same)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, not shape {tuple(tensor.shape)}")
    if tensor.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, not {tensor.dtype}")


# -- linear ------------------------------------------------------------------------------------
#
# On a GPU each tile's product is one `tl.dot` (tensor-core MMA): every output element of a tile
# is reduced by the same instructions whatever row of the tile it is in. The interpreter's
# `tl.dot` is numpy's matmul, whose BLAS gives a row other bits depending on its place in the
# tile (the micro-kernel's edge handling), so interpreted runs multiply and sum per row instead:
# same tiles, same K steps, a reduction that is also position-independent.


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   USE_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)
        if not USE_DOT:  # interpreter: a per-row product and sum (see _use_dot)
            acc += tl.sum(a[:, :, None].to(tl.float32) * b[None, :, :].to(tl.float32), axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T -> [m, n] in x's dtype, float32 accumulation, one fixed tile."""
    _check("x", x, 2)
    _check("weight", weight, 2)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x has {x.shape[1]} columns but weight has {weight.shape[1]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = LINEAR_TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _linear_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32, USE_DOT=not INTERPRETED)
    return y


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product in float32 through torch's matmul."""
    return (x.float() @ weight.float().T).to(x.dtype)


# -- RMS norm ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["x_ptr"])  # the reduction's layout must not follow x's alignment
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, axis=0) / D
    scale = 1.0 / tl.sqrt(mean + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * scale * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [m, d] / sqrt(mean(x^2) + eps) * weight [d], float32 math, one program per row."""
    _check("x", x, 2)
    _check("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: x rows have {x.shape[1]} values but weight has {weight.shape[0]}")
    x = x.contiguous()
    m, d = x.shape
    y = torch.empty_like(x)
    if m:
        _rms_norm_kernel[(m,)](x, weight.contiguous(), y, d, x.stride(0), y.stride(0), float(eps),
                               BLOCK_D=triton.next_power_of_2(d))
    return y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


# -- attention ---------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "L"])
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, stat_ptr, M, L, D, group, scale,
                            sq_h, sq_m, sk_h, sk_l, sv_h, sv_l, n_splits,
                            SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (head, row, split): online softmax over keys [s*SPLIT, min((s+1)*SPLIT, pos+1))."""
    h = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // group
    pos = tl.load(pos_ptr + i).to(tl.int32)
    start = s * SPLIT
    end = tl.minimum(start + SPLIT, pos + 1)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    q = tl.load(q_ptr + h * sq_h + i * sq_m + dims, mask=dmask, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kmask = keys < end
        tile = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kvh * sk_h + keys[:, None] * sk_l + dims[None, :], mask=tile, other=0.0).to(tl.float32)
        scores = tl.sum(q[None, :] * k, axis=1) * scale
        scores = tl.where(kmask, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_ptr + kvh * sv_h + keys[:, None] * sv_l + dims[None, :], mask=tile, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    slot = (h * M + i) * n_splits + s
    tl.store(acc_ptr + slot * BLOCK_D + dims, acc)
    tl.store(stat_ptr + slot * 2, m_i)
    tl.store(stat_ptr + slot * 2 + 1, l_i)


@triton.jit(do_not_specialize=["M"])
def _attention_combine_kernel(acc_ptr, stat_ptr, pos_ptr, out_ptr, M, D, so_h, so_m, n_splits,
                              SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (head, row): its splits 0..pos // SPLIT merged in order."""
    h = tl.program_id(0)
    i = tl.program_id(1)
    pos = tl.load(pos_ptr + i).to(tl.int32)
    used = pos // SPLIT + 1
    base = (h * M + i) * n_splits
    top = -float("inf")
    for s in range(0, used):
        top = tl.maximum(top, tl.load(stat_ptr + (base + s) * 2))
    dims = tl.arange(0, BLOCK_D)
    total = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, used):
        weight = tl.exp(tl.load(stat_ptr + (base + s) * 2) - top)
        total = total + tl.load(stat_ptr + (base + s) * 2 + 1) * weight
        acc = acc + tl.load(acc_ptr + (base + s) * BLOCK_D + dims) * weight
    out = acc / total
    tl.store(out_ptr + h * so_h + i * so_m + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal GQA attention: q [heads, m, d] over k, v [kv_heads, L, d]; row i sees keys 0..q_positions[i].

    Keys are split at fixed absolute positions (multiples of ATTENTION_SPLIT); each split is an
    online softmax in float32, and a row's splits are merged in order by a second kernel.
    """
    _check("q", q, 3)
    _check("k", k, 3)
    _check("v", v, 3)
    heads, m, d = q.shape
    kv_heads, length, kd = k.shape
    if v.shape != k.shape or kd != d:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [kv_heads, L, {d}]")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    if q_positions.shape != (m,) or q_positions.dtype != torch.int64:
        raise ValueError(f"attention: q_positions must be int64 of shape ({m},)")
    out = torch.empty(heads, m, d, dtype=q.dtype, device=q.device)
    if m == 0:
        return out
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    q = q.contiguous()
    n_splits = triton.cdiv(length, ATTENTION_SPLIT)
    block_d = triton.next_power_of_2(d)
    for r0 in range(0, m, ATTENTION_ROWS):
        r1 = min(m, r0 + ATTENTION_ROWS)
        rows, positions = r1 - r0, q_positions[r0:r1].contiguous()
        partial = torch.empty(heads, rows, n_splits, block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(heads, rows, n_splits, 2, dtype=torch.float32, device=q.device)
        q_rows, out_rows = q[:, r0:r1], out[:, r0:r1]
        _attention_split_kernel[(heads, rows, n_splits)](
            q_rows, k, v, positions, partial, stats, rows, length, d, heads // kv_heads, float(scale),
            q_rows.stride(0), q_rows.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), n_splits,
            SPLIT=ATTENTION_SPLIT, BLOCK_N=ATTENTION_BLOCK, BLOCK_D=block_d)
        _attention_combine_kernel[(heads, rows)](partial, stats, positions, out_rows, rows, d, out_rows.stride(0),
                                                 out_rows.stride(1), n_splits, SPLIT=ATTENTION_SPLIT, BLOCK_D=block_d)
    return out


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Masked softmax attention in float32 with the kv heads repeated for each query group."""
    group = q.shape[0] // k.shape[0]
    kf = k.float().repeat_interleave(group, dim=0)
    vf = v.float().repeat_interleave(group, dim=0)
    scores = (q.float() @ kf.transpose(1, 2)) * scale
    keys = torch.arange(k.shape[1], device=q.device)
    scores = scores.masked_fill(keys[None, None, :] > q_positions[None, :, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)
