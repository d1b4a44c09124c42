"""Linear layers on a GGUF's own blocks (csrc/block_gemm.c): weights in the bytes the file holds them.

A Q4_K_M model read this way streams 4.5-6.5 bits a weight per token instead of int8's 8 (plus its
int8 output head), needs no conversion at load (the blocks are a view of the file's memory map),
and multiplies with llama.cpp's own activation blocks (int8 per 256 values for the K-quants, per 32
for the others), so its numerics are llama.cpp's. The sums are integers and each output's float
chain over the blocks is fixed, so a row's bits never depend on the pass, the threads or the path
(AVX2 or portable C): row-exact by construction, as `int8_linear` is.

`BlockLinear` is one GEMM over one or more weights that read the same input (q / k / v, gate / up:
in Qwen2.5-Coder's Q4_K_M file v and some down projections are Q6_K while the rest is Q4_K, so a
call mixes types), their outputs side by side.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agentfold.kernels import native

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES: dict[str, list | tuple[list, object]] = {
    "block_gemm_block": ([_INT, _PTR, _PTR], _INT),
    "block_gemm_avx2": ([], _INT),
    "block_linear": ([_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT], _INT),
}
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
VERSION = 1  # bump when the arithmetic changes (part of snapshot keys)


def library() -> ctypes.CDLL | None:
    return native.load(SIGNATURES)


def supported(type_name: str, k: int) -> bool:
    """Whether a weight of this GGUF type with rows of k values runs here on its blocks."""
    lib = library()
    if lib is None or type_name not in TYPE_IDS:
        return False
    values, size = ctypes.c_int64(), ctypes.c_int64()
    return bool(lib.block_gemm_block(TYPE_IDS[type_name], ctypes.byref(values), ctypes.byref(size))) and \
        k % values.value == 0


@dataclass
class BlockWeight:
    """A weight [n, k] as a GGUF tensor's blocks: `data` uint8 [n * row_bytes] (a view of the file's
    memory map, or any array holding the same bytes)."""

    type_name: str
    data: np.ndarray
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def nbytes(self) -> int:
        return int(self.data.nbytes)


class BlockLinear:
    """One GEMM over weights that read the same input, outputs side by side (`linear`)."""

    def __init__(self, weights: Sequence[BlockWeight]) -> None:
        if not weights or len({w.k for w in weights}) != 1:
            raise ValueError("a block linear needs weights of one input width")
        self.weights = list(weights)
        self.k = weights[0].k
        self.n = sum(w.n for w in weights)
        count = len(weights)
        self._data = (ctypes.c_void_p * count)(*(w.data.ctypes.data for w in weights))
        self._types = (ctypes.c_int * count)(*(TYPE_IDS[w.type_name] for w in weights))
        self._ns = (ctypes.c_int64 * count)(*(w.n for w in weights))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def sizes(self) -> list[int]:
        return [w.n for w in self.weights]

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.weights)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
        """x [m, k] float32 (rows may be strided) -> float32 [m, n] (+ bias), row-exact."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.stride(1) != 1 or not x.is_cpu:
            x = x.float().contiguous().cpu()
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=torch.float32)
        if bias is not None:
            bias = bias.float().contiguous()
        lib = library()
        if lib is None:
            raise RuntimeError("block_linear: no C compiler here")
        status = lib.block_linear(x.data_ptr(), m, self.k, x.stride(0), len(self.weights), self._data, self._types,
                                  self._ns, bias.data_ptr() if bias is not None else None, out.data_ptr(), self.n,
                                  torch.get_num_threads() if threads is None else threads)
        if status == -2:
            raise MemoryError(f"block_linear: no memory for [{m}, {self.k}] activations")
        if status:
            raise ValueError(f"block_linear: a weight type or shape it cannot run ({[w.type_name for w in self.weights]})")
        return out


def describe() -> dict[str, str]:
    lib = library()
    path = "none" if lib is None else ("avx2" if lib.block_gemm_avx2() else "portable")
    return {"linear": f"block_gemm/{VERSION}", "weights": "GGUF blocks", "activations": "int8 per 256 (K) / 32",
            "block_gemm": f"block_gemm.c/{path}"}
