"""Row-exact linear layers by construction: integer operands, exact integer sums (torch).

A linear layer y = x W^T is computed as

    y[m, n] = sx[m] * sw[n] * (256 * (hi[m] . q[n]) + (lo[m] . q[n]))

- q [N, K] int8: the weight quantized per output channel (sw[n] = max |W[n, :]| / 127);
- x's row m quantized to a 16-bit integer per row (sx[m] = max |x[m, :]| / 32512), each block of
  EXP_BLOCK (64) of them rounded to 8 significant bits (an int8 mantissa times 2^e, e in 0..8 the
  smallest that holds the block's largest value: `block_round`), and split into two int8 halves,
  x_q = 256 * hi + lo with hi, lo in [-128, 127];
- both halves go through ONE int8 x int8 -> int32 GEMM (rows [hi; lo]), which reads the weights
  once for all 2m rows: the C kernel `int8_gemm` (AVX-512 VNNI, AVX2 or portable C, on weights
  packed once at load) where a compiler built it, else `torch._int_mm`. On AVX-512 VNNI, from 4
  rows, the C kernel multiplies the m rows of block mantissas instead (one vpdpbusd pass, not
  two) and shifts each block's exact sums by its exponent: the same integers as the halves give.

Why it is exact whatever kernel runs: every product and partial sum is an integer, and int32
holds them with room to spare (|sum| <= 128 * 127 * K < 2^31 for any K up to 131,000), so the
GEMM's blocking, vector width, thread count and order of summation cannot change a bit. What
remains is per-element IEEE arithmetic (one division, one rounding, a few multiplies and adds in
a fixed order) and an exact max per row: the bits of row m never depend on the other rows. The
same argument holds on any CPU (AVX2, AVX-512, NEON), any BLAS and any thread count, for any
kernel that computes the true integer sums. (torch._int_mm does not on x86 CPUs without VNNI:
oneDNN's int8 kernels there saturate pair sums to int16 (vpmaddubsw), so its results are
consistent but not the products; `int8_gemm` is exact on every path, and torch._int_mm is only
used where no compiler is, or where it was checked exact here and is faster.)

Cost in quality: the weights are rounded to 8 bits per output channel; the activations keep about
15 bits per row, and 8 significant bits per block of 64 (as llama.cpp's q8 activation blocks, with
a power-of-two scale per block). SmolLM2-135M's perplexity on `bench quality`'s text: 4.672 in
float32, 4.654 with int16 rows (arithmetic version 1), 4.691 with the blocks (+0.4% from float32;
per-row int8 would be 4.864, +4.1%). The blocks halve the multiply-adds of a verify pass of many
rows, which on a CPU without AMX are its largest cost (`bench lanes`). Cost in speed: none; int8
weights read 4x fewer bytes than float32, and on x86 the int8 GEMM is faster than the float one.
Since every kernel gives the same integers, which one runs is a question of speed only:
`int8_gemm.matmul` picks per weight shape and row count, by timing, between the C kernel and
torch._int_mm (an Intel CPU's AMX is faster at prefill sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentfold.kernels import int8_gemm, int8_rows

VERSION = 2  # bump when the arithmetic changes (it is part of snapshot keys); 2: activations per block
WEIGHT_LEVELS = 127  # int8 weights in [-127, 127]
HALF = 256  # x_q = HALF * hi + lo
ACT_LEVELS = 127 * HALF  # 32512: |x_q| <= this keeps hi in [-127, 127] and lo in [-128, 127]
EXP_BLOCK = int8_gemm.EXP_BLOCK  # columns per exponent block of a row's integers
MANTISSA_LEVELS = 127  # each block's integers are mantissas in [-127, 127] times 2^e, e in 0..8


@dataclass
class Int8Weight:
    """A weight [N, K] as int8 values per output channel with float32 scales; once `pack`ed, in the
    C kernel's layout too (the plain values then kept only where torch._int_mm may run them)."""

    values: torch.Tensor | None  # int8 [N, K], contiguous (torch._int_mm's operand, as its [K, N] transpose)
    scales: torch.Tensor  # float32 [N]
    packed: int8_gemm.PackedWeight | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape if self.packed is not None else tuple(self.values.shape)

    def nbytes(self) -> int:
        held = self.packed.nbytes() if self.packed is not None else self.values.numel()
        return held + 4 * self.scales.numel()

    def int8_values(self) -> torch.Tensor:
        """The int8 [N, K] values (read back out of the packed layout where they were not kept)."""
        return self.values if self.values is not None else int8_gemm.unpack(self.packed)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this int8 weight stands for (quality checks)."""
        return self.int8_values().float() * self.scales[:, None]


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """Round a float weight [N, K] to int8 per output channel (symmetric, max-abs scale)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / WEIGHT_LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(w / scales[:, None]).clamp_(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return Int8Weight(values.contiguous(), scales.contiguous())


def concat(weights: list[Int8Weight]) -> Int8Weight:
    """Weights that read the same input, stacked along N: one GEMM computes all of them."""
    return Int8Weight(torch.cat([w.int8_values() for w in weights]).contiguous(), torch.cat([w.scales for w in weights]))


def pack(weight: Int8Weight) -> None:
    """Give `weight` the C GEMM's layout (`int8_gemm`, where a compiler built it), in place. Its
    plain values are kept only where torch._int_mm is faster here at prefill sizes, so that
    `int8_gemm.matmul` can hand those passes to it; elsewhere they are dropped (the weights are
    held once). Both kernels give the same integers: this decides speed and memory, never bits."""
    if weight.packed is not None or not int8_gemm.available():
        return
    keep = not int8_gemm.faster_than_torch(weight.shape, int8_gemm.BUCKETS[-1])
    if keep:  # time every row bucket now, not inside the first (timed) passes
        for rows in int8_gemm.BUCKETS:
            int8_gemm.faster_than_torch(weight.shape, rows)
    weight.packed = int8_gemm.pack(weight.values, keep_values=keep)
    if not keep:
        weight.values = None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, K] as int8 halves [2m, K] (hi rows, then lo rows) and a float32 scale per row [m].

    Per element: one division by the row's scale, round half to even; then per block of EXP_BLOCK
    columns, the block's exponent e (the smallest in 0..8 with max |q| <= 127 * 2^e) and q rounded
    half to even to a multiple of 2^e (an exact division by 2^e); a floor division by 256. Exact
    IEEE and integer operations, so a row's integers depend only on that row (csrc/int8_rows.c's
    quantize_one computes the same ones).
    """
    xf = x.float()
    scales = xf.abs().amax(dim=1) / ACT_LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(xf / scales[:, None]).clamp_(-ACT_LEVELS, ACT_LEVELS)
    q = block_round(q)
    hi = torch.div(q + HALF // 2, HALF, rounding_mode="floor")
    lo = q - hi * HALF
    return torch.cat([hi, lo]).to(torch.int8), scales


def block_round(q: torch.Tensor) -> torch.Tensor:
    """Integers q [m, K] (float, |q| <= ACT_LEVELS) -> int32, each block of EXP_BLOCK columns as
    int8 mantissas times 2^e (e: the block's exponent, see `quantize_rows`)."""
    m, k = q.shape
    padded = torch.nn.functional.pad(q, (0, -k % EXP_BLOCK)).view(m, -1, EXP_BLOCK)
    biggest = padded.abs().amax(dim=2, keepdim=True)
    exponent = sum((biggest > MANTISSA_LEVELS * 2**e).to(torch.int32) for e in range(8))
    step = torch.pow(2.0, exponent.to(q.dtype))
    rounded = torch.round(padded / step) * step  # q / 2^e is exact (|q| < 2^15)
    return rounded.view(m, -1)[:, :k].to(torch.int32)


def int_mm(halves: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """halves [r, K] int8 @ the weight's transpose -> int32 [r, N]: exact, whatever kernel runs."""
    if weight.packed is not None:
        return int8_gemm.matmul(halves, weight.packed)
    return torch._int_mm(halves, weight.values.t())


def combine(sums: torch.Tensor, row_scales: torch.Tensor, weight: Int8Weight,
            bias: torch.Tensor | None) -> torch.Tensor:
    """int32 sums [2m, N] of the hi and lo halves -> float32 [m, N]."""
    m = row_scales.shape[0]
    combined = (sums[:m].to(torch.int64) * HALF + sums[m:]).float()  # exact, then one rounding
    y = combined * row_scales[:, None] * weight.scales[None, :]
    return y + bias.float() if bias is not None else y


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, K] (float) times the int8 weight's transpose -> float32 [m, N] (+ bias), row-exact.

    The per-row steps run in the small C library (`int8_rows`) when it could be built, else as
    torch ops; both compute the same IEEE operations in the same order, so they give the same bits.
    Where the C GEMM multiplies (`int8_gemm.runs_here`), the three steps are one C call.
    """
    lib = int8_rows.library() if x.device.type == "cpu" else None
    if lib is None:
        halves, row_scales = quantize_rows(x)
        return combine(int_mm(halves, weight), row_scales, weight, bias)
    bias = bias.float().contiguous() if bias is not None else None
    m, k = x.shape
    if weight.packed is not None and int8_gemm.runs_here(weight.packed, 2 * m):
        return int8_gemm.linear(x, weight.packed, weight.scales, bias)
    x = x.float().contiguous()
    n = weight.shape[0]
    halves = torch.empty(2 * m, k, dtype=torch.int8)
    row_scales = torch.empty(m, dtype=torch.float32)
    threads = torch.get_num_threads()
    lib.quantize_rows(x.data_ptr(), m, k, halves.data_ptr(), row_scales.data_ptr(), threads)
    sums = int_mm(halves, weight).contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib.combine(sums.data_ptr(), m, n, row_scales.data_ptr(), weight.scales.data_ptr(),
                bias.data_ptr() if bias is not None else None, out.data_ptr(), threads)
    return out


def describe() -> dict[str, str]:
    return {"linear": f"int8_linear/{VERSION}", "weights": "int8 per channel", "activations": f"int16 per row, 8 bits per {EXP_BLOCK}",
            **int8_gemm.describe()}
