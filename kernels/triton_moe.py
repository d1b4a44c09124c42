"""Grouped int8 expert products on the GPU: every device-held expert of a layer in one launch.

Rows routed to the same expert are laid out together, padded to whole blocks of `GROUP_BLOCK`
rows; each block names the pool slot holding its expert, and a program multiplies one block by
one tile of that expert's int8 matrix with int32 accumulation. Integer sums are exact, so the
result equals the CPU tier's (`engine.expert_quant.int_matmul`) bit for bit, whatever the tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_BLOCK = 16  # rows per block (BLOCK_M)
_TILE_N, _TILE_K = 64, 64


@triton.jit(do_not_specialize=["R"])
def _grouped_int8_kernel(a_ptr, rows_ptr, slot_ptr, w_ptr, out_ptr, R, N, K, stride_a, stride_ws, stride_wn,
                         stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    source = tl.load(rows_ptr + r, mask=r < R, other=-1)
    valid = source >= 0
    source = tl.where(valid, source, 0).to(tl.int64)
    slot = tl.load(slot_ptr + block).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + source[:, None] * stride_a + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0)
        w = tl.load(w_ptr + slot * stride_ws + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
        # out_dtype explicit: older Tritons (3.6, for one) default it to float32 whatever acc's type, and the
        # GPU compile then rejects the int32 accumulator (the interpreter never checks it)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
    out = out_ptr + r[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, acc, mask=valid[:, None] & (rn[None, :] < N))


def grouped_int_matmul(a: torch.Tensor, rows: torch.Tensor, block_slot: torch.Tensor,
                       pool: torch.Tensor) -> torch.Tensor:
    """int32 [len(rows), N]: row r is a[rows[r]] @ pool[block_slot[r // GROUP_BLOCK]].T (rows[r] < 0: padding).

    a int8 [T, K]; rows int32 [R], R a multiple of GROUP_BLOCK; block_slot int32 [R / GROUP_BLOCK];
    pool int8 [S, N, K]. Padding rows of the result are left uninitialized.
    """
    if a.dtype != torch.int8 or pool.dtype != torch.int8:
        raise ValueError(f"grouped_int_matmul takes int8 operands, not {a.dtype} and {pool.dtype}")
    if pool.dim() != 3 or a.shape[1] != pool.shape[2]:
        raise ValueError(f"grouped_int_matmul: a {tuple(a.shape)} does not match pool {tuple(pool.shape)}")
    if rows.shape[0] % GROUP_BLOCK or block_slot.shape[0] != rows.shape[0] // GROUP_BLOCK:
        raise ValueError("grouped_int_matmul: rows must fill whole blocks, one slot per block")
    a, pool = a.contiguous(), pool.contiguous()
    n, k = pool.shape[1], pool.shape[2]
    out = torch.empty(rows.shape[0], n, dtype=torch.int32, device=a.device)
    if rows.shape[0] == 0:
        return out
    grid = (block_slot.shape[0], triton.cdiv(n, _TILE_N))
    _grouped_int8_kernel[grid](a, rows, block_slot, pool, out, rows.shape[0], n, k, a.stride(0), pool.stride(0),
                               pool.stride(1), out.stride(0), BLOCK_M=GROUP_BLOCK, BLOCK_N=_TILE_N, BLOCK_K=_TILE_K)
    return out
