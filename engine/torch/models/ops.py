"""The operations whose bits could depend on the other rows of a pass, dispatched per device.

Row j of a k-row verify pass must give the bits of a one-row step, so the models never call
torch's matmul, norm or attention directly: on CUDA they go to the batch-invariant Triton kernels
(`kernels.triton_ops`, imported only when a CUDA tensor arrives), on CPU to the row-exact CPU
kernels (`kernels.torch_cpu`). SiLU, GELU, sigmoid and softmax are here too, because torch's CPU
vector loop and its scalar tail compute exp and tanh differently. Everything else a model does (add,
multiply, gathers, casts, top-k) is exact IEEE arithmetic per element: the same bits for any number
of rows. Sliding-window attention (Gemma 3's local layers) is here for the prefill chunks and for
CUDA; CPU decode and verify rows take the window in the lane attention kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from agentfold.kernels import int8_linear, torch_cpu
from agentfold.kernels.int8_linear import Int8Weight
from agentfold.kernels.torch_cpu import LaneKV

WINDOW_BLOCK = 32  # query rows per windowed prefill block (see `windowed_attention`)


def _triton():
    from agentfold.kernels import triton_ops

    return triton_ops


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T (+ bias) -> [m, n]; int8 weights run the integer GEMM (exact by construction)."""
    if isinstance(weight, Int8Weight):
        y = int8_linear.linear(x, weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    y = _triton().linear(x, weight) if x.is_cuda else torch_cpu.linear(x, weight)
    return y + bias if bias is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm of each row of x [m, d], times weight [d]."""
    return _triton().rms_norm(x, weight, eps) if x.is_cuda else torch_cpu.rms_norm(x, weight, eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) for x [m, d] (CPU: row by row where torch's vector loop would mix rows)."""
    return torch.nn.functional.silu(x) if x.is_cuda else torch_cpu.silu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`), row by row where needed."""
    if x.is_cuda:
        return F.gelu(x, approximate="tanh")
    return torch_cpu.rowwise(lambda rows: F.gelu(rows, approximate="tanh"), x, transcendental=True)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if x.is_cuda else torch_cpu.sigmoid(x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last axis of x [m, d]."""
    return torch.softmax(x.float(), dim=-1) if x.is_cuda else torch_cpu.softmax(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float, window: int | None = None) -> torch.Tensor:
    """Causal GQA attention: q [heads, m, d] over k, v [kv_heads, L, d]; row i sees keys 0..q_positions[i],
    or with a `window` only its last `window` keys (a sliding-window layer, `windowed_attention`)."""
    if window is not None and int(q_positions.max()) >= window:
        return windowed_attention(q, k, v, q_positions, scale, window)
    if q.is_cuda:
        return _triton().attention(q, k, v, q_positions, scale)
    return torch_cpu.attention(q, k, v, q_positions, scale)


def lane_attention(q: torch.Tensor, lanes: Sequence[LaneKV], scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of a pass's rows, lane by lane: q [m, heads, d] holds each lane's rows in
    turn; lane (begin, rows, start, keys, values) has rows begin..begin+rows at positions start..
    over its own cache's keys / values [kv_heads, capacity, d]. -> [m, heads, d]. On CPU decode and
    verify passes run every lane in one row-exact C call; otherwise `attention` per lane."""
    if not q.is_cuda:
        out = torch_cpu.lane_attention(q, lanes, scale, window)
        if out is not None:
            return out
    outputs = []
    for begin, rows, start, keys, values in lanes:
        positions = torch.arange(start, start + rows, device=q.device)
        outputs.append(attention(q[begin : begin + rows].transpose(0, 1).contiguous(), keys[:, : start + rows],
                                 values[:, : start + rows], positions, scale, window))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)).transpose(0, 1)


def describe(device: torch.device) -> dict[str, str]:
    """Which kernels run on `device` (part of a snapshot key: another kernel gives other bytes)."""
    if device.type == "cuda":
        import triton

        return {"kernels": "triton_ops", "version": str(getattr(_triton(), "VERSION", "1")),
                "triton": triton.__version__, "gpu": torch.cuda.get_device_name(device)}
    return {"kernels": "torch_cpu", "version": str(torch_cpu.VERSION), "isa": torch.backends.cpu.get_cpu_capability(),
            "attention": torch_cpu.attention_kernel()}


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                       scale: float, window: int) -> torch.Tensor:
    """Row i of q [heads, m, d] sees keys max(0, p - window + 1)..p of k, v, where p = q_positions[i].

    A short pass (decode, verify) runs each row alone over exactly its window's keys, the call a
    one-row step makes: row-exact by construction (on CPU it is the causal kernel's own row call,
    which is also what a row whose window still starts at 0 gets from `attention`). A longer pass
    is a prefill chunk: blocks of query rows over the keys their windows span, masked on both
    sides; its bits follow the chunk plan, like the causal kernels' prefill blocks. The blocks are
    small: a block spans its rows plus window - 1 keys, and large score tensors are slow on CPU
    (512 rows of Gemma 3 270M, window 512: 37 ms in 32-row blocks, 90 in 64-row, ~290 in 256-row).
    """
    positions = q_positions.tolist()
    if q.shape[1] <= torch_cpu.PER_ROW_LIMIT:
        rows = [_attend_window_row(q[:, i : i + 1], k, v, p, max(0, p - window + 1), scale)
                for i, p in enumerate(positions)]
        return torch.cat(rows, dim=1)
    blocks = []
    for first in range(0, q.shape[1], WINDOW_BLOCK):
        last = min(first + WINDOW_BLOCK, q.shape[1])
        low, end = max(0, min(positions[first:last]) - window + 1), max(positions[first:last]) + 1
        blocks.append(_attend_window_block(q[:, first:last], k[:, low:end], v[:, low:end],
                                           q_positions[first:last] - low, scale, window))
    return torch.cat(blocks, dim=1)


def _attend_window_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, low: int,
                       scale: float) -> torch.Tensor:
    """One query row q [heads, 1, d] over keys low..position (the CUDA kernel sees them as 0..position-low)."""
    keys, values = k[:, low : position + 1], v[:, low : position + 1]
    if q.is_cuda:
        last = torch.tensor([position - low], dtype=torch.int64, device=q.device)
        return _triton().attention(q, keys, values, last, scale)
    return torch_cpu.attend_row(q[:, 0], keys, values, scale).unsqueeze(1)


def _attend_window_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                         scale: float, window: int) -> torch.Tensor:
    """Query rows q [heads, m, d] at key offsets `q_offsets` over k, v [kv_heads, L, d]: row i sees
    the keys j with 0 <= q_offsets[i] - j < window, in two matmuls and a masked float32 softmax."""
    heads, m, d = q.shape
    kv_heads, length, _ = k.shape
    by_group = q.reshape(kv_heads, (heads // kv_heads) * m, d)  # head h reads kv head h // group
    logits = (torch.matmul(by_group, k.transpose(1, 2)).float() * scale).view(kv_heads, -1, m, length)
    distance = q_offsets[:, None] - torch.arange(length, device=k.device)[None, :]
    unseen = (distance < 0) | (distance >= window)
    weights = torch.softmax(logits.masked_fill(unseen, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(weights.view(kv_heads, -1, length), v).view(heads, m, d)
