"""An exact int8 x int8 -> int32 GEMM in C (csrc/int8_gemm.c): a drop-in for `torch._int_mm(halves, values.t())`.

Why swapping the kernel cannot change a bit: every product of two int8 values and every partial sum
is an integer, and int32 holds all of them (|sum| <= 255 * 127 * K < 2^31 for K < 66,000, the bound
of the largest partial sum on any path), so no order of summation, blocking, vector width or
thread count can give another result. Integer addition is associative; exactness could only be lost
to saturation or overflow, and the C paths never saturate (AVX-512 VNNI vpdpbusd wraps and never
reaches the wrap; the AVX2 path multiplies int16 with vpmaddwd instead of the saturating vpmaddubsw)
or overflow. The AVX-512 path feeds vpdpbusd (u8 x s8) the activations offset by 128 (A xor 0x80)
and subtracts 128 * colsum(W[n]) at the end: an identity of integers, exact as well.

Why it is faster than torch._int_mm at decode sizes: the weight is packed once (`pack`) into the
operand layout of vpdpbusd (16 output channels x 4 k per 64-byte vector), each weight vector is read
once per call for all rows with software prefetch, and the threads split the output channels, so at
M = 2..16 the call streams the weights at close to memory bandwidth; at larger M, register tiles of
up to 4 x 16 channels x 6 rows keep vpdpbusd busy. On an Intel Xeon with AMX-INT8 (`isa()` "amx-int8")
calls of 12 rows or more run on the tiles instead (tdpbusd: the same u8 x s8 products and int32 sums,
about ten times vpdpbusd's rate; the packed layout is already its B operand), so a verify pass of 16
rows of every reply costs little more than the weights' streaming. Where torch._int_mm is still
faster `matmul` picks it: `faster_than_torch` times both once per process per (N, K, M bucket,
threads), torch's call right after one of ours, as it runs in a pass (the kernels' pool keeps its
workers spinning for a millisecond after a job, and torch's OpenMP threads then wait for a core:
timed alone, torch._int_mm looked faster at 16-64 rows here and cost 1 ms a call in a pass). Since
both are exact the choice never changes a bit. torch._int_mm is NOT exact on x86 CPUs without VNNI
(oneDNN's AVX2 and plain AVX-512 int8 kernels use vpmaddubsw, whose int16 pair sums saturate: try
ONEDNN_MAX_CPU_ISA=AVX2), so `faster_than_torch` also checks torch's result on full-range operands
and never picks it where it differs.

Without a C compiler (or AGENTFOLD_NATIVE=0) `available()` is False and `pack` / `int_mm` raise
RuntimeError: check `available()` once and keep torch._int_mm on the plain int8 weight otherwise.
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from agentfold.kernels import native

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES: dict[str, list | tuple[list, object]] = {
    "int8_gemm_isa": ([], _INT),
    "int8_gemm_packed_size": ([_I64, _I64], _I64),
    "int8_gemm_pack": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "int8_gemm": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _INT], _INT),
    "int8_gemm_chunk_sums": [_PTR, _I64, _I64, _PTR],
    "int8_linear_blocks": ([_I64, _I64], _INT),
    "int8_linear": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT], _INT),
}
ISA_NAMES = {3: "amx-int8", 2: "avx512-vnni", 1: "avx2", 0: "portable"}
BLOCK, GROUP = 16, 4  # the packed layout: blocks of 16 output channels, k in groups of 4
EXP_BLOCK = 64  # k per exponent block of the activations (csrc/int8_rows.h; `int8_linear.EXP_BLOCK`)


def library() -> ctypes.CDLL | None:
    """The kernels' library with csrc/int8_gemm.c's functions (built on first use, `native`); None
    where it cannot be built or loaded."""
    return native.load(SIGNATURES)


def available() -> bool:
    """Whether the C kernel can run here (a compiler built it)."""
    return library() is not None


def isa() -> str:
    """Which path the library compiled: "avx512-vnni", "avx2", "portable", or "none" without it.
    All give the same integers; this only says how fast."""
    lib = library()
    return "none" if lib is None else ISA_NAMES.get(lib.int8_gemm_isa(), "unknown")


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@dataclass
class PackedWeight:
    """An int8 weight [N, K] in the kernel's layout: data[block][k group][16][4] (N padded to a
    multiple of 16, K to a multiple of 4, with zeros), the exact int32 sum of each channel, and
    each channel's sum over each EXP_BLOCK of k (the block kernel's offset correction)."""

    data: torch.Tensor  # int8 [round_up(N, 16) * round_up(K, 4)]
    colsums: torch.Tensor  # int32 [round_up(N, 16)]
    n: int
    k: int
    values: torch.Tensor | None = None  # the int8 [N, K] it was packed from, if kept (torch._int_mm's operand)
    chunk_sums: torch.Tensor | None = None  # int32 [ceil(round_up(K, 4) / EXP_BLOCK), round_up(N, 16)]

    def __post_init__(self) -> None:
        if self.data.dtype != torch.int8 or not self.data.is_contiguous() or self.data.numel() != (
                _round_up(self.n, BLOCK) * _round_up(self.k, GROUP)):
            raise ValueError("PackedWeight.data must be the contiguous int8 packed layout of an [n, k] weight")
        if self.colsums.dtype != torch.int32 or not self.colsums.is_contiguous() or self.colsums.numel() != (
                _round_up(self.n, BLOCK)):
            raise ValueError("PackedWeight.colsums must be contiguous int32 [round_up(n, 16)]")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def nbytes(self) -> int:
        extra = self.values.numel() if self.values is not None else 0
        chunks = 4 * self.chunk_sums.numel() if self.chunk_sums is not None else 0
        return self.data.numel() + 4 * self.colsums.numel() + extra + chunks


def pack(values: torch.Tensor, keep_values: bool = False) -> PackedWeight:
    """Pack an int8 weight [N, K] (values in [-127, 127], as int8_linear makes them; -128 is exact
    too) for `int_mm`. One pass over the weight in C (about a memory copy). With `keep_values` the
    original stays referenced so that `matmul` can hand it to torch._int_mm when that is faster."""
    lib = _LIB[0] if _LIB else _library_or_raise()
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"expected an int8 [N, K] weight, got {values.dtype} {tuple(values.shape)}")
    w = values.contiguous()
    n, k = w.shape
    data = torch.empty(lib.int8_gemm_packed_size(n, k), dtype=torch.int8)
    colsums = torch.empty(_round_up(n, BLOCK), dtype=torch.int32)
    lib.int8_gemm_pack(w.data_ptr(), n, k, k, data.data_ptr(), colsums.data_ptr(), torch.get_num_threads())
    chunk_sums = torch.empty(-(-_round_up(k, GROUP) // EXP_BLOCK), _round_up(n, BLOCK), dtype=torch.int32)
    lib.int8_gemm_chunk_sums(data.data_ptr(), n, k, chunk_sums.data_ptr())
    return PackedWeight(data, colsums, n, k, values if keep_values else None, chunk_sums)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The int8 [N, K] weight a packed one holds (its kept `values`, or read back out of the layout)."""
    if packed.values is not None:
        return packed.values
    blocks, groups = _round_up(packed.n, BLOCK) // BLOCK, _round_up(packed.k, GROUP) // GROUP
    rows = packed.data.view(blocks, groups, BLOCK, GROUP).permute(0, 2, 1, 3).reshape(blocks * BLOCK, groups * GROUP)
    return rows[: packed.n, : packed.k].contiguous()


def int_mm(halves: torch.Tensor, packed: PackedWeight, threads: int | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """halves int8 [M, K] times the packed weight's transpose -> int32 [M, N], equal bit for bit to
    torch._int_mm(halves, values.t()) (exact integer sums, see the module docstring). Any M >= 1;
    rows may be strided (the last dimension must be contiguous, else a copy is made). `threads`
    defaults to torch.get_num_threads(); the result does not depend on it. `out`, if given, must
    be a contiguous int32 [M, N] CPU tensor. About 3 us of Python and ctypes per call."""
    lib = _LIB[0] if _LIB else _library_or_raise()
    if halves.dtype != torch.int8 or halves.dim() != 2:
        raise ValueError(f"expected int8 [M, {packed.k}], got {halves.dtype} {tuple(halves.shape)}")
    m, k = halves.shape
    lda, step = halves.stride()
    if k != packed.k:
        raise ValueError(f"expected int8 [M, {packed.k}], got {halves.dtype} {tuple(halves.shape)}")
    if step != 1 or not halves.is_cpu:
        halves = halves.contiguous().cpu()
        lda = k
    n = packed.n
    if out is None:
        out = torch.empty((m, n), dtype=torch.int32)
    elif out.dtype != torch.int32 or out.shape != (m, n) or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"out must be a contiguous int32 [{m}, {n}] CPU tensor")
    if m == 0:
        return out
    if lib.int8_gemm(halves.data_ptr(), m, k, lda, packed.data.data_ptr(), packed.colsums.data_ptr(), n, out.data_ptr(), n,
                     torch.get_num_threads() if threads is None else threads):
        raise MemoryError(f"int8_gemm: no memory for the activations of an [{m}, {packed.k}] call")
    return out


_LIB: list[ctypes.CDLL] = []  # the loaded library, once int_mm has found it


def _library_or_raise() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("int8_gemm: no C compiler here (see available())")
    _LIB.append(lib)
    return lib


# --- choosing between this kernel and torch._int_mm (both exact: the choice changes speed, never bits)

_CHOICE: dict[tuple[int, int, int, int], bool] = {}
BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket(m: int) -> int:
    """The M bucket a timing decision covers: the smallest of BUCKETS >= m (the last for larger m)."""
    for b in BUCKETS:
        if m <= b:
            return b
    return BUCKETS[-1]


def _best_time(fn, repeats: int) -> float:
    """The best of `repeats` timings of fn() (after one to warm up); a fn that returns a float
    reports its own time (the part of it being timed)."""
    fn()  # warm up (and build, the first time)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        own = fn()
        best = min(best, own if isinstance(own, float) else time.perf_counter() - start)
    return best


def faster_than_torch(packed: PackedWeight | tuple[int, int], m: int, threads: int | None = None) -> bool:
    """Whether `int_mm` should run rather than torch._int_mm for this weight shape (N, K) at m rows:
    True when `int_mm` is at least as fast, or torch._int_mm fails, or torch._int_mm is NOT exact
    here. (It is not on x86 CPUs without VNNI: oneDNN's AVX2 / AVX-512 kernels use vpmaddubsw,
    whose int16 pair sums saturate; with ONEDNN_MAX_CPU_ISA=AVX2 almost every sum of random int8
    operands is off. The check compares the two on random operands with full-range values.)
    Timed once per machine per (N, K, M bucket, threads, library, torch version) with random
    operands (speed depends on the shapes only; the weight's own values when `packed` kept them),
    and remembered in the kernels' cache folder, so a later start of the same model times nothing
    (on a 2-core AMD EPYC without VNNI, torch._int_mm took 1.8 s a call at 512 rows, and timing it
    was 45 s of every start of Qwen2.5-Coder-1.5B). False where the C kernel is not available."""
    if not available():
        return False
    n, k = packed.shape if isinstance(packed, PackedWeight) else packed
    threads = threads if threads is not None else torch.get_num_threads()
    key = (n, k, bucket(m), threads)
    if key not in _CHOICE:
        remembered = _remembered().get(_choice_name(key))
        _CHOICE[key] = remembered if isinstance(remembered, bool) else _time_both(packed, n, k, bucket(m), threads)
        if not isinstance(remembered, bool):
            _remember(_choice_name(key), _CHOICE[key])
    return _CHOICE[key]


PROBE_CHANNELS = 8192  # a wider weight is timed on its first this-many channels (the speed per channel is the same)


def _choices_file() -> Path:
    return native.cache_folder() / "gemm-choices.json"


def _choice_name(key: tuple[int, int, int, int]) -> str:
    """A decision's name on disk: the shape, bucket and threads, and what decides the speeds (the
    built library, which is keyed by the sources, compiler and CPU, and torch's version)."""
    return f"{native.identity()}|torch {torch.__version__}|n{key[0]} k{key[1]} m{key[2]} t{key[3]}"


def _remembered() -> dict[str, bool]:
    if _DISK:
        return _DISK[0]
    try:
        known = json.loads(_choices_file().read_text())
    except (OSError, ValueError):
        known = {}
    _DISK.append(known if isinstance(known, dict) else {})
    return _DISK[0]


def _remember(name: str, choice: bool) -> None:
    known = _remembered()
    known[name] = choice
    try:
        folder = _choices_file().parent
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as staging:
            staging.write(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(staging.name, _choices_file())
    except OSError:
        pass  # unremembered: timed again by the next process


_DISK: list[dict[str, bool]] = []  # the decisions on disk, read once per process


def _time_both(packed: PackedWeight | tuple[int, int], n: int, k: int, rows: int, threads: int) -> bool:
    n = min(n, PROBE_CHANNELS)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (rows, k), dtype=torch.int8, generator=g)
    probe = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    kept = packed.values if isinstance(packed, PackedWeight) else None
    w = kept[:n].contiguous() if kept is not None else probe
    ours, mine = pack(w), pack(probe) if kept is not None else None
    out = torch.empty(rows, n, dtype=torch.int32)
    repeats = 3 if n * k * rows > 1 << 28 else 10
    ours_s = _best_time(lambda: int_mm(a, ours, threads, out), repeats)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        few = a[:2].contiguous()  # saturation shows on any row of full-range values: check exactness cheaply
        exact = torch.equal(torch._int_mm(few, probe.t()), int_mm(few, mine if mine is not None else ours, threads))
        torch_s = float("inf")
        if exact:
            timed = _after_ours(lambda: torch._int_mm(a, w.t()), ours, k, threads)
            first = timed()
            torch_s = first if first > 2 * ours_s else min(first, _best_time(timed, repeats))  # far slower: once is enough
    except RuntimeError:
        torch_s = float("inf")
    finally:
        torch.set_num_threads(before)
    return ours_s <= torch_s


def _after_ours(call, packed: PackedWeight, k: int, threads: int):
    """`call` as a pass meets it: right after a small call of this kernel (so with the pool's
    workers still spinning for the core torch's threads want); timed is `call` alone."""
    row, out = torch.zeros(1, k, dtype=torch.int8), torch.empty(1, packed.n, dtype=torch.int32)

    def timed() -> float:
        int_mm(row, packed, threads, out)
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return timed


def runs_here(packed: PackedWeight, m: int) -> bool:
    """Whether this kernel (rather than torch._int_mm) multiplies `m` rows by the weight: always,
    unless its plain values were kept and torch._int_mm is faster at this row count (both exact)."""
    return packed.values is None or faster_than_torch(packed, m)


def matmul(halves: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """halves [M, K] int8 @ weight.T -> int32 [M, N] with whichever kernel is faster here (both
    exact, so the same bits either way); torch._int_mm needs the weight's `values` kept (`pack`'s
    keep_values), else this kernel always runs."""
    if not runs_here(packed, halves.shape[0]):
        return torch._int_mm(halves, packed.values.t())
    return int_mm(halves, packed)


def linear(x: torch.Tensor, packed: PackedWeight, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The whole int8 linear layer of `int8_linear.linear` in one C call: x [m, K] float32 (rows may
    be strided) -> float32 [m, N], each row quantized to its int8 halves, this kernel's exact sums,
    combined with the row and weight scales (+ bias) by the very functions `int8_rows` runs, so
    the same bits as quantize / GEMM / combine called one by one (one job of the thread pool
    instead of three, and no int32 [2m, N] tensor)."""
    lib = _LIB[0] if _LIB else _library_or_raise()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != packed.k or x.stride(1) != 1 or not x.is_cpu:
        x = x.float().contiguous().cpu()
    m = x.shape[0]
    out = torch.empty(m, packed.n, dtype=torch.float32)
    chunk_sums = packed.chunk_sums.data_ptr() if packed.chunk_sums is not None else None
    if lib.int8_linear(x.data_ptr(), m, packed.k, x.stride(0), packed.data.data_ptr(), packed.colsums.data_ptr(), chunk_sums,
                       packed.n, scales.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                       torch.get_num_threads()):
        raise MemoryError(f"int8_gemm: no memory for an [{m}, {packed.k}] linear")
    return out


def block_kernel_runs(m: int, k: int) -> bool:
    """Whether `linear` of m rows over k multiplies block mantissas (one pass) rather than the two
    halves (the same integers either way: csrc/int8_gemm.c's block kernel)."""
    lib = library()
    return lib is not None and bool(lib.int8_linear_blocks(m, k))


def describe() -> dict[str, str]:
    blocks = "+blocks" if block_kernel_runs(16, 1024) else ""
    return {"int8_gemm": f"int8_gemm.c/{isa()}{blocks}"}
