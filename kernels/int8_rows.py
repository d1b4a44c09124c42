"""The C helpers of `int8_linear` (csrc/int8_rows.c), built and loaded by `native`.

Quantizing a row and combining the GEMM's integer sums are a dozen tiny torch ops each, and at
decode sizes their dispatch costs more than the GEMM; one C call does each. Without a compiler
`library()` returns None and `int8_linear` runs the same arithmetic as torch ops (same bits, slower).
"""

from __future__ import annotations

import ctypes

from agentfold.kernels import native

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_INT = ctypes.c_int
SIGNATURES = {"quantize_rows": [_PTR, _I64, _I64, _PTR, _PTR, _INT],
              "combine": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT]}


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None where it cannot be built or loaded."""
    return native.load(SIGNATURES)
