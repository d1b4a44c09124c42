"""The arithmetic of an offloaded expert, chosen so every tier gives the same bits.

An expert is computed in three steps:

1. integer products: activations quantized to int8 per token (fp32 scale) against weights
   quantized to int8 per output row (fp32 scale), summed in int32. Integer sums do not depend on
   order, so a GPU kernel, a CPU BLAS or a worker thread gives the same int32 accumulators.
2. the float epilogue: dequantize (one multiply by the product of the two scales), SiLU, the
   up-projection product, and requantization of the hidden row to int8 for the down projection.
   SiLU's `exp` differs between CPU and GPU libraries (and, on CPU, between torch's vector and
   scalar loops), so this step always runs on the model's device, whatever tier computed the
   integers, and on CPU in row chunks that never straddle a vector loop's tail.
3. the down projection (integers again), dequantized on the device, and the k experts of a
   token summed in slot order.

So an expert held on the device and one computed from host memory give identical outputs, and
a token's result depends only on its own row (verify rows stay exact).

On CPU the int8 products go through float32 BLAS in chunks of `K_CHUNK` columns: every partial
sum of at most 1024 products of values in [-127, 127] is an integer below 2^24, which float32
(and TF32 / bfloat16 inputs with float32 accumulation) represents exactly, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

VERSION = 1  # bump when the arithmetic changes (the bytes of a reply depend on it)
QMAX = 127
K_CHUNK = 1024  # 1024 * 127 * 127 < 2 ** 24: float32 sums of this many int8 products are exact
_ROW_CHUNK_ELEMENTS = 16384  # below torch's parallel grain size: one thread, one vector loop


@dataclass
class QuantizedLayer:
    """One MoE layer's experts as int8 rows with float32 scales (`gate_up` stacks gate over up)."""

    gate_up: torch.Tensor  # int8 [E, 2I, H]
    down: torch.Tensor  # int8 [E, H, I]
    gate_up_scale: torch.Tensor  # float32 [E, 2I]
    down_scale: torch.Tensor  # float32 [E, H]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def inner(self) -> int:
        return self.down.shape[2]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    @property
    def expert_bytes(self) -> int:
        """int8 bytes of one expert's matrices (what a device slot holds)."""
        return 3 * self.inner * self.hidden


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last axis: (int8 values, float32 scale per row)."""
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 of x [n, H] (float32 math): (int8 [n, H], float32 scale [n])."""
    if x.dim() != 2:
        raise ValueError(f"activations must be [tokens, hidden], not shape {tuple(x.shape)}")
    return quantize_rows(x)


def quantize_layer(gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                   device: torch.device | str = "cpu") -> QuantizedLayer:
    """Quantize float experts (gate/up [E, I, H], down [E, H, I]) one expert at a time on `device`.

    The int8 matrices land on the CPU (the host copy every tier reads from); the scales stay
    on `device`, where every epilogue runs.
    """
    experts, inner, hidden = gate_proj.shape
    if up_proj.shape != gate_proj.shape or down_proj.shape != (experts, hidden, inner):
        raise ValueError(f"expert shapes do not match: gate {tuple(gate_proj.shape)}, up {tuple(up_proj.shape)}, "
                         f"down {tuple(down_proj.shape)}")
    gate_up = _host_empty((experts, 2 * inner, hidden), device)
    down = _host_empty((experts, hidden, inner), device)
    gu_scale = torch.empty(experts, 2 * inner, dtype=torch.float32, device=device)
    d_scale = torch.empty(experts, hidden, dtype=torch.float32, device=device)
    for e in range(experts):
        stacked = torch.cat([gate_proj[e].to(device), up_proj[e].to(device)])
        q, s = quantize_rows(stacked)
        gate_up[e].copy_(q)
        gu_scale[e] = s
        q, s = quantize_rows(down_proj[e].to(device))
        down[e].copy_(q)
        d_scale[e] = s
    return QuantizedLayer(gate_up, down, gu_scale, d_scale)


def _host_empty(shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """int8 host storage, page-locked when a GPU will copy from it."""
    return torch.empty(shape, dtype=torch.int8, pin_memory=torch.device(device).type == "cuda")


def random_layer(experts: int, inner: int, hidden: int, generator: torch.Generator,
                 device: torch.device | str = "cpu", std: float = 0.02, chunk: int = 16) -> QuantizedLayer:
    """Random normal experts (std `std`), generated and quantized `chunk` experts at a time on `device`.

    What a benchmark of a checkpoint that does not exist locally measures: real shapes, realistic
    value ranges, never the float weights of a whole layer in memory at once.
    """
    gate_up = _host_empty((experts, 2 * inner, hidden), device)
    down = _host_empty((experts, hidden, inner), device)
    gu_scale = torch.empty(experts, 2 * inner, dtype=torch.float32, device=device)
    d_scale = torch.empty(experts, hidden, dtype=torch.float32, device=device)
    for e0 in range(0, experts, chunk):
        e1 = min(experts, e0 + chunk)
        q, s = quantize_rows(torch.randn(e1 - e0, 2 * inner, hidden, generator=generator, device=device) * std)
        gate_up[e0:e1].copy_(q)
        gu_scale[e0:e1] = s
        q, s = quantize_rows(torch.randn(e1 - e0, hidden, inner, generator=generator, device=device) * std)
        down[e0:e1].copy_(q)
        d_scale[e0:e1] = s
    return QuantizedLayer(gate_up, down, gu_scale, d_scale)


def int_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int8 a [r, K] @ w [N, K].T -> int32 [r, N], through float32 BLAS in exact chunks."""
    if a.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"int_matmul takes int8 operands, not {a.dtype} and {w.dtype}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"int_matmul: a has {a.shape[1]} columns but w has {w.shape[1]}")
    out = torch.zeros(a.shape[0], w.shape[0], dtype=torch.int32, device=a.device)
    for k0 in range(0, a.shape[1], K_CHUNK):
        part = a[:, k0 : k0 + K_CHUNK].float() @ w[:, k0 : k0 + K_CHUNK].float().T
        out += part.to(torch.int32)
    return out


def _silu_rows(t: torch.Tensor) -> torch.Tensor:
    """SiLU with each row's bits independent of the tensor around it (see the module docstring)."""
    if t.is_cuda or t.shape[0] <= 1:
        return F.silu(t)
    width = t.shape[1]
    rows = max(1, _ROW_CHUNK_ELEMENTS // width) if width % 64 == 0 else 1
    if rows >= t.shape[0]:
        return F.silu(t)
    return torch.cat([F.silu(t[i : i + rows]) for i in range(0, t.shape[0], rows)])


def swiglu_requant(acc: torch.Tensor, row_scale: torch.Tensor,
                   weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float epilogue between the two projections, on the device.

    acc int32 [r, 2I] (gate over up), row_scale [r] (the token's activation scale), weight_scale
    [r, 2I] (the expert's row scales): silu(gate) * up, requantized per row -> (int8 [r, I], scale [r]).
    """
    inner = acc.shape[1] // 2
    gate_up = acc.float() * (row_scale[:, None] * weight_scale)
    hidden = _silu_rows(gate_up[:, :inner].contiguous()) * gate_up[:, inner:]
    return quantize_rows(hidden)


def dequantize(acc: torch.Tensor, row_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """int32 [r, N] accumulators -> float32, times (row scale x weight row scale)."""
    return acc.float() * (row_scale[:, None] * weight_scale)


def combine(outputs: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs [n, k, H] weighted by gates [n, k], summed in slot order."""
    total = gates[:, 0:1] * outputs[:, 0]
    for j in range(1, outputs.shape[1]):
        total = total + gates[:, j : j + 1] * outputs[:, j]
    return total


def expert_forward(layer: QuantizedLayer, e: int, xq: torch.Tensor, x_scale: torch.Tensor,
                   gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> torch.Tensor:
    """One expert for rows xq [r, H] (int8) on xq's device: float32 [r, H].

    `gate_up` / `down` are the expert's int8 matrices where they are held (default: the host copy).
    """
    gu = layer.gate_up[e] if gate_up is None else gate_up
    dn = layer.down[e] if down is None else down
    device = layer.gate_up_scale.device
    acc = int_matmul(xq.to(gu.device), gu).to(device)
    rows = xq.shape[0]
    hq, h_scale = swiglu_requant(acc, x_scale.to(device), layer.gate_up_scale[e].expand(rows, -1))
    acc = int_matmul(hq.to(dn.device), dn).to(device)
    return dequantize(acc, h_scale, layer.down_scale[e].expand(rows, -1))
