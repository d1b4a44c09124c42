"""Linear layers on a GGUF's own blocks (csrc/block_gemm.c): weights in the bytes the file holds them.

A Q4_K_M model read this way streams 4.5-6.5 bits a weight per token instead of int8's 8 (plus its
int8 output head), needs no conversion at load (the blocks are a view of the file's memory map;
with AVX2, every type is repacked 8 channels to a block on first use, the same bytes reordered,
~1 s for the 1.1 GB coder model on 2 cores, and the file's pages are handed back), and multiplies
with llama.cpp's own activation blocks (int8 per 256 values for the K-quants, per 32 for the
others: Q4_0 .. Q8_0 and MXFP4, gpt-oss's experts), so its numerics are llama.cpp's. The sums are
integers and each output's float chain over the blocks is fixed, so a row's bits never depend on the
pass, the threads or the path (AVX2 or portable C): row-exact by construction, as `int8_linear` is.

`BlockLinear` is one GEMM over one or more weights that read the same input (q / k / v, gate / up:
in Qwen2.5-Coder's Q4_K_M file v and some down projections are Q6_K while the rest is Q4_K, so a
call mixes types), their outputs side by side.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from agentfold.kernels import native

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES: dict[str, list | tuple[list, object]] = {
    "block_gemm_block": ([_INT, _PTR, _PTR], _INT),
    "block_gemm_avx2": ([], _INT),
    "block_gemm_vnni": ([], _INT),
    "block_gemm_amx": ([], _INT),
    "block_gemm_amx_calls": ([], _I64),
    "block_gemm_amx_min_rows": ([], _INT),
    "block_linear": ([_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT], _INT),
    "block_linear_rows": ([_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR, _PTR, _PTR, _INT], _INT),
    "block_gemm_packed_type": ([_INT], _INT),
    "block_gemm_packed_bytes": ([_INT, _I64, _I64], _I64),
    "block_gemm_pack": ([_INT, _PTR, _I64, _I64, _PTR, _INT], _INT),
}
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
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
    _forms: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def kernel_form(self, lib: ctypes.CDLL) -> tuple[int, np.ndarray]:
        """The type id and bytes `lib` multiplies: the file's blocks, or (where the build has the AVX2
        kernels) the same blocks repacked 8 channels to a block, made once per library."""
        if lib._name not in self._forms:
            type_id, data = TYPE_IDS[self.type_name], self.data
            packed_id = lib.block_gemm_packed_type(type_id)
            if packed_id:
                data = np.empty(lib.block_gemm_packed_bytes(type_id, self.n, self.k), dtype=np.uint8)
                if lib.block_gemm_pack(type_id, self.data.ctypes.data, self.n, self.k, data.ctypes.data,
                                       torch.get_num_threads()):
                    raise ValueError(f"block_gemm_pack: cannot repack a {self.type_name} [{self.n}, {self.k}] weight")
                type_id = packed_id
                _release_file_pages(self.data)
            self._forms[lib._name] = (type_id, data)
        return self._forms[lib._name]


def _release_file_pages(array: np.ndarray) -> None:
    """Drop a file-backed array's whole pages from this process's memory once a repacked copy holds its
    bytes: the page cache keeps them, and a later read maps them back, but the weights count once in
    RSS instead of twice (a Q4_K_M file's linears: ~1 GB). Anonymous memory is left alone (dropping it
    would zero it)."""
    owner: object = array
    while isinstance(owner, (np.ndarray, memoryview)):
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    if not isinstance(owner, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-array.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (array.ctypes.data + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


class BlockLinear:
    """One GEMM over weights that read the same input, outputs side by side (`linear`)."""

    def __init__(self, weights: Sequence[BlockWeight]) -> None:
        if not weights or len({w.k for w in weights}) != 1:
            raise ValueError("a block linear needs weights of one input width")
        self.weights = list(weights)
        self.k = weights[0].k
        self.n = sum(w.n for w in weights)
        count = len(weights)
        self._ns = (ctypes.c_int64 * count)(*(w.n for w in weights))
        self._arguments: dict[str, tuple[ctypes.Array, ctypes.Array]] = {}

    def segments(self, lib: ctypes.CDLL) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
        """The C arrays `block_linear` in `lib` takes for the segments: their data pointers and type
        ids (the forms that library multiplies, repacked where it repacks) and output counts."""
        if lib._name not in self._arguments:
            forms = [w.kernel_form(lib) for w in self.weights]
            self._arguments[lib._name] = ((ctypes.c_void_p * len(forms))(*(data.ctypes.data for _, data in forms)),
                                        (ctypes.c_int * len(forms))(*(type_id for type_id, _ in forms)))
        data, types = self._arguments[lib._name]
        return data, types, self._ns

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
        return self._call(x, bias, threads, per_segment_rows=False)

    def linear_rows(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                    threads: int | None = None) -> torch.Tensor:
        """Segment s times row s of x [segments, k] -> float32 [1, n] (+ bias), the segments' outputs
        side by side: a MoE decode row's k down projections, each on its own expert's input, in one
        call. Each output has the bits of `BlockLinear([segment]).linear(x[s : s + 1])`."""
        return self._call(x, bias, threads, per_segment_rows=True)

    def _call(self, x: torch.Tensor, bias: torch.Tensor | None, threads: int | None,
              per_segment_rows: bool) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.stride(1) != 1 or not x.is_cpu:
            x = x.float().contiguous().cpu()
        m = x.shape[0]
        if per_segment_rows and m != len(self.weights):
            raise ValueError(f"block_linear_rows: {m} rows for {len(self.weights)} segments")
        out = torch.empty(1 if per_segment_rows else m, self.n, dtype=torch.float32)
        if bias is not None:
            bias = bias.float().contiguous()
        lib = library()
        if lib is None:
            raise RuntimeError("block_linear: no C compiler here")
        data, types, ns = self.segments(lib)
        head = (x.data_ptr(), m, self.k, x.stride(0), len(self.weights), data, types, ns,
                bias.data_ptr() if bias is not None else None, out.data_ptr())
        threads = torch.get_num_threads() if threads is None else threads
        status = lib.block_linear_rows(*head, threads) if per_segment_rows else lib.block_linear(*head, self.n, threads)
        if status == -2:
            raise MemoryError(f"block_linear: no memory for [{m}, {self.k}] activations")
        if status:
            raise ValueError(f"block_linear: a weight type or shape it cannot run ({[w.type_name for w in self.weights]})")
        return out


def describe() -> dict[str, str]:
    lib = library()
    path = "none" if lib is None else ("avx2+vnni+amx" if lib.block_gemm_amx() else "avx2+vnni" if lib.block_gemm_vnni()
                                       else "avx2" if lib.block_gemm_avx2() else "portable")
    return {"linear": f"block_gemm/{VERSION}", "weights": "GGUF blocks", "activations": "int8 per 256 (K) / 32",
            "block_gemm": f"block_gemm.c/{path}"}
