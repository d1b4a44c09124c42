"""The row-wise ops of a decoder layer in C (csrc/rowwise.c): RMSNorm, SiLU / GELU-tanh times up, RoPE.

At decode sizes (1..64 rows) a layer's ~40 small torch ops cost more in dispatch than their
arithmetic, and torch's own kernels are not row-exact (a vectorized main loop with a scalar tail
that computes exp differently, reductions split across threads), which is why `torch_cpu.rowwise`
splits calls per row. One C call per op, row-exact by construction, fixes both: each row's result
is a fixed sequence of IEEE operations on that row alone, whatever the other rows, the row count,
the thread count or an element's column (see csrc/rowwise.c for each op's sequence).

Each function returns None where it does not apply: no C compiler (or AGENTFOLD_NATIVE=0), or an
input that is not a float32 CPU tensor; the caller then runs its torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from agentfold.kernels import native

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "rms_norm": [_PTR, _I64, _I64, _PTR, ctypes.c_float, _I64, _PTR, _INT],
    "silu_mul": [_PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "gelu_tanh_mul": [_PTR, _PTR, _I64, _I64, _I64, _PTR, _INT],
    "rope": ([_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _INT], _INT),
    "float_rows": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT],
}
_LIBRARY: list[ctypes.CDLL | None] = []  # `native.load`'s answer, kept here: these calls are a few us each


def library() -> ctypes.CDLL | None:
    """The kernels' library with csrc/rowwise.c's functions (built on first use, `native`); None
    where it cannot be built or loaded."""
    if not _LIBRARY:
        _LIBRARY.append(native.load(SIGNATURES))
    return _LIBRARY[0]


def _cpu_float(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add_one: bool = False) -> torch.Tensor | None:
    """Each row of x [..., d] over its root mean square, times weight [d] (add_one: times 1 + weight,
    Gemma's norm), float32 -> float32; None where the C library or a float32 CPU x is missing.

    Row-exact by construction: a row's sum of squares runs on one thread in 16 vector lanes (its
    last chunk zero-padded) and a fixed tree, then r = 1 / sqrt(sum / d + eps), out = (x * r) * w.
    Within float32 rounding of `torch_cpu._rms_norm` (only the summation order differs)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not weight.is_cpu:
        return None
    d = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != d:
        raise ValueError(f"weight {tuple(weight.shape)} for rows of {d}")
    x = x.contiguous()
    weight = (weight if weight.dtype == torch.float32 else weight.float()).contiguous()
    out = torch.empty_like(x)
    m = x.numel() // d if d else 0
    if m:
        lib.rms_norm(x.data_ptr(), m, d, weight.data_ptr(), eps, int(add_one), out.data_ptr(),
                     torch.get_num_threads())
    return out


def _gated(name: str, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor | None:
    lib = library()
    if lib is None or not _cpu_float(gate) or (up is not None and not _cpu_float(up)):
        return None
    if up is None:  # one fused GEMM output [m, 2n]: gate is columns 0..n-1, up n..2n-1
        if gate.dim() != 2 or gate.shape[1] % 2:
            raise ValueError(f"gate_up {tuple(gate.shape)} is not [m, 2n]")
        if gate.shape[1] > 1 and gate.stride(1) != 1:
            gate = gate.contiguous()
        (m, n), stride = (gate.shape[0], gate.shape[1] // 2), gate.stride(0)
        gate_ptr = gate.data_ptr()
        up_ptr = gate_ptr + n * gate.element_size()
    else:
        if gate.dim() != 2 or gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ or are not [m, n]")
        m, n = gate.shape
        unit = n == 1 or (gate.stride(1) == 1 and up.stride(1) == 1)
        if not unit or (m > 1 and up.stride(0) != gate.stride(0)):
            gate, up = gate.contiguous(), up.contiguous()
        stride, gate_ptr, up_ptr = gate.stride(0), gate.data_ptr(), up.data_ptr()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:  # row i of gate / up at i * stride (any stride for one row)
        getattr(lib, name)(gate_ptr, up_ptr, m, n, stride, out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up -> [m, n] float32, from one fused gate/up output gate [m, 2n] (gate columns
    0..n-1, up n..2n-1) or from gate and up [m, n] (views of one buffer are read in place); None
    where the C library or float32 CPU inputs are missing.

    Row-exact by construction: every element is (g / (1 + exp(-g))) * u through the same vector
    instructions (a row's last partial chunk is zero-padded into a vector), with our own exp, so
    neither its column, its row's neighbours nor the thread count change a bit. Within ~4 ulp of
    torch's F.silu(g) * u (both within ~2 ulp of the true silu)."""
    return _gated("silu_mul", gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.gelu(gate, approximate="tanh") * up -> [m, n] float32, laid out as `silu_mul`'s inputs;
    None where the C library or float32 CPU inputs are missing.

    Row-exact by construction, as `silu_mul`: every element is (g / (1 + exp(-2t))) * u with
    t = sqrt(2/pi) (g + 0.044715 g^3), the same function as 0.5 g (1 + tanh(t)) without its
    cancellation near tanh(t) = -1. For gates above -1 within ~4 ulp of torch (both within ~2 of
    the true value); below, torch's float32 1 + tanh(t) keeps only ~|g| 6e-8 of absolute accuracy
    (~200 ulp off at -3, 0 from about -9 on) where this stays within ~|2t| ulp (its float32
    argument's rounding).
    """
    return _gated("gelu_tanh_mul", gate, up)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of x [m, heads, d] (Hugging Face's half-split layout), row i at position
    positions[i] of the tables cos / sin [L, d] (llama.Rope's) -> [m, heads, d] float32; None where
    the C library or float32 CPU tensors are missing. x may be a view with any row stride (q / k
    out of a fused qkv GEMM) as long as each row's heads are contiguous.

    Bit-identical to llama.Rope.forward's torch expression xf * cos + rotate_half(xf) * sin (per
    element a multiply, a multiply and an add, rotate_half a negation), hence row-exact."""
    lib = library()
    if lib is None or not _cpu_float(x, cos, sin) or not positions.is_cpu:
        return None
    m, heads, d = x.shape
    length, width = cos.shape
    if width != d or sin.shape != cos.shape or positions.shape != (m,):
        raise ValueError(f"x {tuple(x.shape)}, tables {tuple(cos.shape)} {tuple(sin.shape)}, "
                         f"positions {tuple(positions.shape)}")
    strides = x.stride()
    if strides[2] != 1 or strides[1] != d:
        x = x.contiguous()
        strides = x.stride()
    if positions.dtype != torch.int64:
        positions = positions.long()
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(m, heads, d, dtype=torch.float32)
    if lib.rope(x.data_ptr(), m, heads, d, strides[0], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                length, out.data_ptr(), torch.get_num_threads()):
        raise IndexError(f"a position outside the table's {length} rows, or odd head size {d}")
    return out


def float_rows(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [m, k] @ wt [k, n] (+ bias [n]) in float32, every output's sum over k in order, one multiply
    and one add a step: row-exact by construction (a row's bits are its one-row call's), for small
    weights such as a MoE router. None where the C library or float32 CPU operands are missing."""
    lib = library()
    if lib is None or not _cpu_float(x, wt) or (bias is not None and not _cpu_float(bias)) or x.dim() != 2:
        return None
    (m, k), n = x.shape, wt.shape[1]
    if wt.shape[0] != k:
        raise ValueError(f"rows of {k} against weights {tuple(wt.shape)}")
    x, wt = x.contiguous(), wt.contiguous()
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.float_rows(x.data_ptr(), m, k, wt.data_ptr(), n, bias.data_ptr() if bias is not None else None,
                       out.data_ptr(), torch.get_num_threads())
    return out
