"""The operations whose bits could depend on the other rows of a pass, dispatched per device.

Row j of a k-row verify pass must give the bits of a one-row step, so the models never call
torch's matmul, norm or attention directly: on CUDA they go to the batch-invariant Triton kernels
(`kernels.triton_ops`, imported only when a CUDA tensor arrives), on CPU to the row-exact CPU
kernels (`kernels.torch_cpu`). SiLU, GELU, sigmoid and softmax are here too, because torch's CPU
vector loop and its scalar tail compute exp and tanh differently. Everything else a model does (add,
multiply, gathers, casts, top-k) is exact IEEE arithmetic per element: the same bits for any number
of rows. Sliding-window attention (Gemma 3's local layers) is here for CUDA and for CPUs without a
compiler; elsewhere on CPU every pass takes the window in the lane attention kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from agentfold.kernels import int8_linear, rowwise, torch_cpu
from agentfold.kernels.block_linear import BlockLinear
from agentfold.kernels.int8_linear import Int8Weight

if TYPE_CHECKING:
    from agentfold.engine.torch.models.cache import LayerCache

WINDOW_BLOCK = 32  # query rows per windowed prefill block (see `windowed_attention`)


def _triton():
    from agentfold.kernels import triton_ops

    return triton_ops


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight | BlockLinear,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T (+ bias) -> [m, n]; int8 weights and GGUF blocks run integer GEMMs
    (exact by construction)."""
    if isinstance(weight, BlockLinear):
        y = weight.linear(x, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if isinstance(weight, Int8Weight):
        y = int8_linear.linear(x, weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    y = _triton().linear(x, weight) if x.is_cuda else torch_cpu.linear(x, weight)
    return y + bias if bias is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add_one: bool = False) -> torch.Tensor:
    """Root-mean-square norm of each row of x [m, d], times weight [d] (`add_one`: times 1 + weight,
    Gemma's norm). CPU float32: one C call (`kernels.rowwise`, row-exact by construction)."""
    if not x.is_cuda:
        out = rowwise.rms_norm(x, weight, eps, add_one)
        if out is not None:
            return out
    weight = 1.0 + weight.float() if add_one else weight
    return _triton().rms_norm(x, weight, eps) if x.is_cuda else torch_cpu.rms_norm(x, weight, eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) for x [m, d] (CPU: row by row where torch's vector loop would mix rows)."""
    return torch.nn.functional.silu(x) if x.is_cuda else torch_cpu.silu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`), row by row where needed."""
    if x.is_cuda:
        return F.gelu(x, approximate="tanh")
    return torch_cpu.rowwise(lambda rows: F.gelu(rows, approximate="tanh"), x, transcendental=True)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [m, n] (a SwiGLU MLP's hidden rows). CPU float32: one C call
    (`kernels.rowwise`: its own exp, the same instructions for every element)."""
    if not gate.is_cuda:
        out = rowwise.silu_mul(gate, up)
        if out is not None:
            return out
    return silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate, up [m, n] (Gemma's MLP). CPU float32: one C call (`kernels.rowwise`)."""
    if not gate.is_cuda:
        out = rowwise.gelu_tanh_mul(gate, up)
        if out is not None:
            return out
    return gelu_tanh(gate) * up


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Hugging Face's half-split rotary embedding of x [m, heads, d] by the [L, d] tables at each
    row's position, in one C call on CPU float32 (the bits of the torch expression in `Rope`);
    None where that does not apply (the caller runs the torch expression)."""
    return None if x.is_cuda else rowwise.rope(x, positions, cos, sin)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if x.is_cuda else torch_cpu.sigmoid(x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last axis of x [m, d]."""
    return torch.softmax(x.float(), dim=-1) if x.is_cuda else torch_cpu.softmax(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention: q [heads, m, d] over k, v [kv_heads, L, d]; row i sees keys 0..q_positions[i],
    or with a `window` only its last `window` keys (a sliding-window layer, `windowed_attention`).
    `sinks` (float32 [heads], gpt-oss): each query head's sink logit, one more term of every row's
    softmax with no value (`torch_cpu.sink_softmax`). The Triton kernel has no such term: with sinks
    CUDA runs the torch path too (short passes row by row, each row the call a one-row step makes;
    prefill chunks in blocks)."""
    if window is not None and int(q_positions.max()) >= window:
        return windowed_attention(q, k, v, q_positions, scale, window, sinks)
    if q.is_cuda and sinks is None:
        return _triton().attention(q, k, v, q_positions, scale)
    return torch_cpu.attention(q, k, v, q_positions, scale, sinks)


def blocked_keys(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a cache on `device` in `dtype` keeps its keys in blocks of 16 positions (`LayerCache`):
    where the C lane attention reads it."""
    return torch_cpu.reads_cache(device, dtype)


def lane_table(spans: Sequence[tuple[int, int, int]], caches: Sequence[Sequence[LayerCache]]) -> Any:
    """What a pass (lanes `spans`: begin, rows, start) keeps for its layers'
    attention, `caches[slot][lane]` each layer's caches: on CPU the C kernel's table of the lanes
    (`torch_cpu.LaneTable`), built once for every layer; None where attention runs lane by lane
    (CUDA, no compiler)."""
    return torch_cpu.cache_table(spans, caches)


def attend_lanes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lanes: Any, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a pass's rows, lane by lane (`lanes`: a `llama.LayerLanes`): q [m, heads,
    d], k, v [m, kv_heads, d] hold each lane's rows in turn; a lane's keys and values are stored in
    its own cache at its positions, and its rows attend to that cache's keys 0..position (with a
    `window`, the last `window`). -> [m, heads, d]. `sinks` (float32 [heads], gpt-oss): each query
    head's sink logit, one more softmax term with no value (None: none, the same bits as without it).
    On CPU every pass (prefill chunks too) runs every lane in one row-exact C call; otherwise each
    lane is written and runs `attention` on its own."""
    if lanes.table is not None and q.dtype == torch.float32:
        return lanes.table.attend(lanes.slot, q, k, v, scale, window, sinks)
    outputs = []
    for lane in lanes.lanes:
        rows = slice(lane.begin, lane.begin + lane.rows)
        lane.cache.write(lane.start, k[rows].transpose(0, 1), v[rows].transpose(0, 1))
        end = lane.start + lane.rows
        keys, values = lane.cache.read(end)
        if keys.dtype != q.dtype:  # a float16 cache under float32 queries: widened (exactly) for torch's matmul
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        positions = torch.arange(lane.start, end, device=q.device)
        outputs.append(attention(q[rows].transpose(0, 1).contiguous(), keys, values, positions, scale, window, sinks))
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
                       scale: float, window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of q [heads, m, d] sees keys max(0, p - window + 1)..p of k, v, where p = q_positions[i]
    (`sinks` [heads]: each query head's sink logit, as in `attention`).

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
        rows = [_attend_window_row(q[:, i : i + 1], k, v, p, max(0, p - window + 1), scale, sinks)
                for i, p in enumerate(positions)]
        return torch.cat(rows, dim=1)
    blocks = []
    for first in range(0, q.shape[1], WINDOW_BLOCK):
        last = min(first + WINDOW_BLOCK, q.shape[1])
        low, end = max(0, min(positions[first:last]) - window + 1), max(positions[first:last]) + 1
        blocks.append(_attend_window_block(q[:, first:last], k[:, low:end], v[:, low:end],
                                           q_positions[first:last] - low, scale, window, sinks))
    return torch.cat(blocks, dim=1)


def _attend_window_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int, low: int,
                       scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row q [heads, 1, d] over keys low..position (the CUDA kernel sees them as 0..position-low;
    with `sinks`, torch's row call on either device)."""
    keys, values = k[:, low : position + 1], v[:, low : position + 1]
    if sinks is not None:
        return torch_cpu.attend_row(q[:, 0], keys, values, scale, sinks).unsqueeze(1)
    if q.is_cuda:
        last = torch.tensor([position - low], dtype=torch.int64, device=q.device)
        return _triton().attention(q, keys, values, last, scale)
    return torch_cpu.attend_row(q[:, 0], keys, values, scale).unsqueeze(1)


def _attend_window_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
                         scale: float, window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Query rows q [heads, m, d] at key offsets `q_offsets` over k, v [kv_heads, L, d]: row i sees
    the keys j with 0 <= q_offsets[i] - j < window, in two matmuls and a masked float32 softmax (with
    `sinks` [heads], each head's sink logit one more term of it: `torch_cpu.sink_softmax`)."""
    heads, m, d = q.shape
    kv_heads, length, _ = k.shape
    by_group = q.reshape(kv_heads, (heads // kv_heads) * m, d)  # head h reads kv head h // group
    logits = (torch.matmul(by_group, k.transpose(1, 2)).float() * scale).view(kv_heads, -1, m, length)
    distance = q_offsets[:, None] - torch.arange(length, device=k.device)[None, :]
    unseen = (distance < 0) | (distance >= window)
    weights = torch_cpu.sink_softmax(logits.masked_fill(unseen, float("-inf")), sinks).to(v.dtype)
    return torch.matmul(weights.view(kv_heads, -1, length), v).view(heads, m, d)
