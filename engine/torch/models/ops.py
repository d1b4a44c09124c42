"""The operations whose bits could depend on the other rows of a pass, dispatched per device.

Row j of a k-row verify pass must give the bits of a one-row step, so the models never call
torch's matmul, norm or attention directly: on CUDA they go to the batch-invariant Triton kernels
(`kernels.triton_ops`, imported only when a CUDA tensor arrives), on CPU to the row-exact CPU
kernels (`kernels.torch_cpu`). SiLU, sigmoid and softmax are here too, because torch's CPU vector
loop and its scalar tail compute exp differently. Everything else a model does (add, multiply,
gathers, casts, top-k) is exact IEEE arithmetic per element: the same bits for any number of rows.
"""

from __future__ import annotations

import torch

from agentfold.kernels import int8_linear, torch_cpu
from agentfold.kernels.int8_linear import Int8Weight


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


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if x.is_cuda else torch_cpu.sigmoid(x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last axis of x [m, d]."""
    return torch.softmax(x.float(), dim=-1) if x.is_cuda else torch_cpu.softmax(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal GQA attention: q [heads, m, d] over k, v [kv_heads, L, d]; row i sees keys 0..q_positions[i]."""
    if q.is_cuda:
        return _triton().attention(q, k, v, q_positions, scale)
    return torch_cpu.attention(q, k, v, q_positions, scale)


def describe(device: torch.device) -> dict[str, str]:
    """Which kernels run on `device` (part of a snapshot key: another kernel gives other bytes)."""
    if device.type == "cuda":
        import triton

        return {"kernels": "triton_ops", "version": str(getattr(_triton(), "VERSION", "1")),
                "triton": triton.__version__, "gpu": torch.cuda.get_device_name(device)}
    return {"kernels": "torch_cpu", "version": str(torch_cpu.VERSION), "isa": torch.backends.cpu.get_cpu_capability()}
